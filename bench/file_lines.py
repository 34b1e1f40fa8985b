"""Line counts of train_gpt.py: per section, and how many lines are the speedrun computation.

    python3 bench/file_lines.py [PATH]      (default: the repository's train_gpt.py)

Harness lines are those whose purpose is option checks, failure reports and signals,
checkpoints or the launch: section 9 (Launch), the top-level names in HARNESS_NAMES, and inside
train() every statement that deals with a stop, a failure or a checkpoint (the `check` closure,
exception handlers, and statements naming checkpoints, stop, harness, failure or exit codes).
Comments and blank lines count with the code they precede. Everything else is computation:
configuration values, hardware, collectives, kernels, optimizers, model, data, the loop, the log.
Also prints the harness/ modules' sizes and, where ../shared is present, the record's.
"""

import ast
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(REPO, "..", "shared", "peers", "modded-nanogpt_93f0e6b9")  # its train_gpt.py and triton_kernels.py
HARNESS_NAMES = {"ConfigError", "say", "first_line", "check_config", "parse_ns_coeffs", "run_summary", "duration",
                 "NoStopSignals", "STOP_SIGNALS", "EXIT_ERROR", "TrainResult"}
LOOP_HARNESS_WORDS = ("checkpoints", "stop.", "harness(", "failure", "exit_code", "ending", "EXIT_")


def top_level_ranges(tree, n_lines):
    """(first line, last line, node) per top-level statement, each extended up over the comments
    and blank lines above it."""
    nodes = tree.body
    ranges = []
    for i, node in enumerate(nodes):
        start = (nodes[i - 1].end_lineno + 1) if i else 1
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        ranges.append((min(start, first), node.end_lineno, node))
    return ranges


def names_of(node):
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def harness_lines_in_train(func, lines):
    """Lines of train() whose statements handle stops, failures or checkpoints."""
    marked = set()
    for node in ast.walk(func):
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            marked.update(range(node.lineno, node.end_lineno + 1))
        elif isinstance(node, ast.ExceptHandler):
            marked.update(range(node.lineno, node.end_lineno + 1))
        elif isinstance(node, ast.stmt) and not isinstance(node, (ast.For, ast.While, ast.Try, ast.With,
                                                                  ast.FunctionDef)):
            end = node.body[0].lineno - 1 if isinstance(node, ast.If) else node.end_lineno
            text = "\n".join(lines[node.lineno - 1:end])
            if any(word in text for word in LOOP_HARNESS_WORDS):
                marked.update(range(node.lineno, end + 1))
    return marked


def classify(path):
    with open(path) as f:
        source = f.read()
    lines = source.splitlines()
    tree = ast.parse(source)
    section_starts = [(i + 1, line[2:].strip()) for i, line in enumerate(lines)
                      if line.startswith("# ") and line[2:3].isdigit() and ". " in line[:6]]
    launch_start = next((n for n, title in section_starts if title.split(".")[0] == "9"), len(lines) + 1)
    harness = set()
    for first, last, node in top_level_ranges(tree, len(lines)):
        if names_of(node) & HARNESS_NAMES or first >= launch_start:
            harness.update(range(first, last + 1))
        if isinstance(node, ast.FunctionDef) and node.name == "train":
            harness |= harness_lines_in_train(node, lines)
    harness.update(range(launch_start, len(lines) + 1))
    sections = []
    bounds = [n for n, _ in section_starts] + [len(lines) + 1]
    for (start, title), end in zip(section_starts, bounds[1:]):
        sections.append((title, end - start, sum(1 for n in range(start, end) if n in harness)))
    return len(lines), len(harness), sections


def count(path):
    with open(path) as f:
        return sum(1 for _ in f)


def main(argv):
    path = argv[1] if len(argv) > 1 else os.path.join(REPO, "train_gpt.py")
    total, harness, sections = classify(path)
    print(f"{os.path.relpath(path)}: {total} lines, {total - harness} computation "
          f"({100 * (total - harness) / total:.1f}%), {harness} harness")
    for title, n, h in sections:
        print(f"  {title:<36} {n:>5} lines  {h:>4} harness")
    folder = os.path.join(os.path.dirname(os.path.abspath(path)), "harness")
    if os.path.isdir(folder):
        modules = sorted(f for f in os.listdir(folder) if f.endswith(".py"))
        sizes = {m: count(os.path.join(folder, m)) for m in modules}
        print(f"harness/: {sum(sizes.values())} lines (" + ", ".join(f"{m} {n}" for m, n in sizes.items()) + ")")
    files = [os.path.join(RECORD, name) for name in ("train_gpt.py", "triton_kernels.py")]
    if all(map(os.path.isfile, files)):
        total = sum(map(count, files))
        print(f"the record it reproduces ({os.path.basename(RECORD)}: train_gpt.py + triton_kernels.py): {total} lines; "
              f"this file is {count(path) / total:.2f}x (budget 1.5x)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except BrokenPipeError:  # `| head`: a reader that has gone is no error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
