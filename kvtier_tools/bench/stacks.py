"""`python -m kvtier_tools.bench.stacks FILE...`: where a process spent its samples, from py-spy's
collapsed stacks (`py-spy record --format raw --subprocesses --threads`, as
`kvtier_tools.bench.serving --profile` writes them).

For each process and thread: its samples; then, of the samples whose stack passes through
kvtier, the outermost kvtier function of each (what vLLM called into) and the innermost
(where the time went), as shares of that thread's samples; with `--leaves` first the innermost
frame of every sample, whatever code it is in. With py-spy's `--idle` (as
`--profile` samples) a thread's samples are its wall time, its waits included.
"""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]+)(?::\d+)?\)$")


@dataclass
class Thread:
    samples: int = 0
    outer: Counter = field(default_factory=Counter)  # outermost kvtier frame -> samples
    inner: Counter = field(default_factory=Counter)  # innermost kvtier frame -> samples
    leaf: Counter = field(default_factory=Counter)  # innermost frame, any code's -> samples


def read_all(paths: list[Path]) -> dict[tuple[str, str], Thread]:
    """`read` of several files, each thread's counts summed over them."""
    threads: dict[tuple[str, str], Thread] = defaultdict(Thread)
    for path in paths:
        for key, t in read(path).items():
            into = threads[key]
            into.samples += t.samples
            for mine, theirs in zip(
                (into.outer, into.inner, into.leaf), (t.outer, t.inner, t.leaf)
            ):
                mine.update(theirs)
    return threads


def frame_name(frame: str) -> tuple[str, str]:
    """(function, file) of a py-spy frame "func (path/file.py:line)"."""
    m = FRAME.match(frame.strip())
    return (m["func"], m["file"]) if m else (frame.strip(), "")


def is_kvtier(path: str) -> bool:
    return "kvtier/" in path and "site-packages/vllm" not in path


def read(path: Path) -> dict[tuple[str, str], Thread]:
    """(process, thread) -> its samples and kvtier frames (of a file gzipped too: .gz)."""
    threads: dict[tuple[str, str], Thread] = defaultdict(Thread)
    held = ""  # a process's command line may hold a newline: its stack goes on in the next line
    if path.suffix == ".gz":
        with gzip.open(path, "rt", errors="replace") as f:
            text = f.read()
    else:
        text = path.read_text(errors="replace")
    for line in text.splitlines():
        stack, _, count = (held + line).rpartition(" ")
        if not stack or not count.isdigit():
            held += line
            continue
        held = ""
        frames = stack.split(";")
        # A child's stacks name its parents first; a command line may hold ";" too.
        at = next((i for i, f in enumerate(frames) if f.startswith("thread (")), -1)
        head, thread = (frames[:at], frames[at]) if at >= 0 else ([], "thread")
        frames = frames[at + 1 :]
        process = next((f for f in reversed(head) if f.startswith("process ")), "process")
        t = threads[(process[:60], thread)]
        n = int(count)
        t.samples += n
        if frames:
            fn, file = frame_name(frames[-1])
            t.leaf[f"{fn} ({Path(file).name})"] += n
        ours = [
            f"{fn} ({Path(file).name})" for fn, file in map(frame_name, frames) if is_kvtier(file)
        ]
        if ours:
            t.outer[ours[0]] += n
            t.inner[ours[-1]] += n
    return threads


def report(
    threads: dict[tuple[str, str], Thread],
    top: int = 8,
    min_samples: int = 50,
    leaves: bool = False,
) -> list[str]:
    """Per thread of at least `min_samples`: its kvtier frames (`leaves`: its innermost frames,
    whatever code they are in, first)."""
    lines = []
    for (process, thread), t in sorted(threads.items(), key=lambda kv: -kv[1].samples):
        if t.samples < min_samples:
            continue
        ours = sum(t.outer.values())
        lines.append(
            f"{process} {thread}: {t.samples} samples, {ours} ({ours / t.samples:.1%}) in kvtier"
        )
        counters = (("called", t.outer), ("in", t.inner))
        for label, counter in (("leaf", t.leaf),) * leaves + counters:
            for name, n in counter.most_common(top):
                lines.append(f"    {label:6} {n / t.samples:6.1%}  {name}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--min-samples", type=int, default=50)
    p.add_argument("--leaves", action="store_true", help="each thread's innermost frames too")
    args = p.parse_args()
    for path in args.files:
        print(f"== {path}")
        print("\n".join(report(read(path), args.top, args.min_samples, args.leaves)))


if __name__ == "__main__":
    main()
