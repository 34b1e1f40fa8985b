"""What train_gpt.py's computation does not need, beside it: each module is loaded by
train_gpt.harness(name) when a run first uses it, and its source is written into the run's log
after train_gpt.py's. The modules reach the trainer as `train_gpt` (a fork run as a script
registers itself under that name), so one harness serves every fork in this folder.

  config.py       command line and environment, every value checked, --help, near-miss hints
  launch.py       main(): signals, joining the ranks, set-up agreement, one line per way a run ends
  checkpoints.py  save, exact resume at any world size
  sample.py       --sample: text from a checkpoint
"""
