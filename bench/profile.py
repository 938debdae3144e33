"""Where a rank's CPU goes: py-spy or perf sampling a worker over its timed steps, and the table of it.

``bench train --profile DIR`` starts ``py-spy record`` on each of its ranks at the first timed step
(attached to the worker's own pid) and stops it after the last. py-spy samples every thread,
waiting or not; the samples of a thread blocked in a wait are left out (``IDLE``), so the rest's
shares are the shares of the rank's CPU time.
``python -m bench profile DIR`` reads those raw stacks and prints, per run, the CPU a step and rank
by where the innermost Python frame is and by thread (gloo's C++ threads have no Python frame:
DDP's CPU is only in bench train's CPU column).

With ``--sampler perf`` it is ``perf record`` instead, which samples only threads on a core, in
the kernel too, and each sample says which library's code ran: the table's rows are then the
libraries (CPython's interpreter, the kernel, torch with gloo inside it, uvloop, ...), for DDP's
threads as for ours.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

RATE = 100  # samples a second: each pauses the process (--native)
PERF_RATE = 999  # perf's samples a second on a core (an interrupt each, no pause)


class Sampler:
    """``py-spy record`` (or ``perf record``: ``tool="perf"``) on this process from :meth:`start`
    to :meth:`stop`; raw stacks to ``path`` (perf's: a line a thread and library, to ``path``
    with ``.perf`` for ``.txt``)."""

    def __init__(self, path: str, native: bool = True, tool: str = "py-spy") -> None:
        self.tool = tool
        self.path = path if tool == "py-spy" else path.removesuffix(".txt") + ".perf"
        self.native = native
        self._proc = None

    def start(self) -> None:
        found = shutil.which(self.tool, path=os.path.dirname(sys.executable)) or shutil.which(self.tool)
        if found is None:
            raise SystemExit(f"bench train --profile needs {self.tool} (py-spy: pip install py-spy; perf: linux-tools)")
        if self.tool == "perf":
            command = [found, "record", "-F", str(PERF_RATE), "-p", str(os.getpid()), "-o", self.path + ".data"]
        else:
            # Native frames (uvloop's and torch's C) need the process paused at each sample;
            # without them (--nonblocking) a loop thread's stacks come torn, its time in C
            # unattributed.
            how = ["--native"] if self.native else ["--nonblocking"]
            command = [found, "record", "--pid", str(os.getpid()), "--threads", *how]
            command += ["--rate", str(RATE), "--format", "raw", "-o", self.path]
        self._found, self._cpu0, self._io0 = found, thread_cpu(), io_calls()
        self._proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self._proc is None:
            return
        cpu, io = thread_cpu(), io_calls()
        self._proc.send_signal(signal.SIGINT)  # py-spy and perf write what they have and exit
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        spent = {kind: seconds for kind, (seconds, _) in cpu_by_kind(self._cpu0, cpu).items()}
        with open(self.path + ".cpu.json", "w") as f:
            json.dump({**spent, "syscalls": {k: io[k] - self._io0[k] for k in io}}, f)
        if self.tool == "perf":
            names = {tid: name for tid, (name, _, _) in {**self._cpu0, **cpu}.items()}
            script = subprocess.run(
                [self._found, "script", "-i", self.path + ".data", "-F", "tid,ip,dso"],
                capture_output=True,
                text=True,
                check=True,
            )
            with open(self.path, "w") as f:
                f.writelines(perf_lines(script.stdout, names))
            os.remove(self.path + ".data")


def perf_lines(script: str, names: dict) -> list:
    """``perf script -F tid,ip,dso`` output as ``thread (tid): name;library count`` lines, a line
    a thread and shared object (``names``: ``{tid: thread name}``)."""
    counts: collections.Counter = collections.Counter()
    for line in script.splitlines():
        got = re.match(r"\s*(\d+)\s+[0-9a-f]+\s+\((.*)\)\s*$", line)
        if got:
            counts[(int(got.group(1)), got.group(2))] += 1
    return [f"thread ({tid}): {names.get(tid, tid)};{dso} {n}\n" for (tid, dso), n in sorted(counts.items())]


def io_calls() -> dict:
    """This process's read and write system calls so far (``/proc/self/io``: sockets included)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return {"read": int(fields["syscr"]), "write": int(fields["syscw"])}


def thread_cpu() -> dict:
    """``{tid: (name, CPU seconds, runs)}`` of this process's threads, from /proc (C++ threads too):
    the scheduler's nanoseconds and how many times it put the thread on a core (``schedstat``: a
    thread woken from a wait, or preempted and resumed, is one run more), else its CPU ticks and
    no runs (0)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    ns, _, runs = f.read().split()[:3]
                seconds, runs = int(ns) / 1e9, int(runs)
            except OSError:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
                seconds, runs = (int(fields[11]) + int(fields[12])) / tick, 0
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (names.get(int(tid), comm), seconds, runs)
    return out


def cpu_by_kind(before: dict, after: dict) -> dict:
    """``{thread kind: (CPU seconds, runs)}`` between two :func:`thread_cpu` readings (a thread
    that started between them counts from zero)."""
    spent: dict = {}
    for tid, (name, seconds, runs) in after.items():
        _, seconds0, runs0 = before.get(tid, (name, 0.0, 0))
        cpu, n = spent.get(thread_kind(name), (0.0, 0))
        spent[thread_kind(name)] = (cpu + seconds - seconds0, n + runs - runs0)
    return spent


# Where the innermost Python frame is, first match wins: (what, pattern on "function (file:line)").
# C frames under it (NumPy, torch, CPython's own) count where that Python frame is, except the few
# that say where the time went by themselves (C_PLACES).
PLACES = [
    ("receive path (Connection)", r"net/(connection|receive|core)\.py|wire/codec\.py|wire/__init__"),
    ("frame dispatch (Endpoint)", r"net/endpoint\.py|net/local\.py"),
    ("inline work's timing, loop hops (net/loop.py)", r"net/loop\.py"),
    ("send path (shaper, outbox, backpressure)", r"net/(shaper|backpressure)\.py|ps/outbox\.py"),
    ("shard aggregation (PS server)", r"ps/(server|shard|tally|slots|sgd|node)\.py"),
    ("PS client", r"ps/(client|pulls)\.py|sync/(ps|hierarchical_ps)\.py"),
    ("all-reduce", r"sync/(allreduce|collective|hierarchical)\.py"),
    ("SFB and factors", r"sync/(sfb|hierarchical_sfb|adam)\.py|wire/(factors|lowrank)\.py"),
    ("syncer bookkeeping", r"sync/|train/(dispatch|layers|merging|staging)\.py|cluster/book\.py"),
    ("trainer step and hooks", r"train/|poseidon_aio/"),
    ("optimizer", r"torch/optim/"),
    ("autograd and torch ops", r"torch/"),
    ("executor hops and futures", r"concurrent/futures|asyncio/|threading\.py|queue\.py"),
    ("replayed compute (bench)", r"bench/models\.py"),
    ("bench harness", r"bench/"),
]
C_PLACES = [
    ("socket system calls", r"^(write|writev|read|readv|send|sendmsg|sendto|recv|recvmsg|recvfrom) \(libc"),
    ("Python's garbage collector", r"^gc_collect"),
]
_PYTHON = re.compile(r"\.py:\d+\)$")
# The compiled parts run under the loop's C with no Python frame of their own: their native frames
# (and the compiled decoder's under the receive core) are their place, up to a Python callback.
_COMPILED = [
    (re.compile(r"_ctally|tally\.pyx"), "shard aggregation (PS server)"),
    (re.compile(r"_creceive|receive\.pyx"), "receive path (Connection)"),
]
# A thread blocked in one of these is off the CPU: py-spy's --native samples it all the same (an
# idle executor thread, a loop in epoll, a replayed layer's sleep), and /proc's CPU shared over
# such samples would land on waits. What the wait's own system call costs stays unattributed.
IDLE = re.compile(
    r"^(epoll_p?wait|poll|select|pselect6?|clock_nanosleep|nanosleep|pthread_cond_(timed|clock)?wait|"
    r"sem_(timed|clock)?wait|PyThread_acquire_lock_timed|accept4?|__futex_abstimed_wait\w*) "
)


# perf's samples by the shared object whose code ran, first match wins.
LIBRARIES = [
    ("CPython's interpreter (libpython)", r"libpython"),
    ("the kernel (system calls, TCP, softirqs)", r"kernel"),
    ("torch's C++ (gloo is in it)", r"libtorch|libc10|libgloo"),
    ("uvloop", r"uvloop"),
    ("NumPy", r"numpy"),
    ("our compiled parts (codec, receive core, tally)", r"poseidon_aio"),
    ("crc32c", r"crc32c"),
    ("libc, the C++ runtime, the loader", r"libc\.so|libstdc\+\+|ld-linux|libm\.so|libgomp|vdso|libpthread"),
]


UNSAMPLED = "not sampled (a window too short for perf: give more --steps)"


def library(dso: str) -> str:
    for what, pattern in LIBRARIES:
        if re.search(pattern, dso):
            return what
    return "other"


def read_libraries(path: str) -> collections.Counter:
    """``Counter((thread kind, library): samples)`` of one :func:`perf_lines` file."""
    samples: collections.Counter = collections.Counter()
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            thread, _, dso = stack.partition(";")
            if not count.isdigit() or not thread.startswith("thread "):
                continue
            samples[(thread_kind(thread.partition(": ")[2]), library(dso))] += int(count)
    return samples


def idle(frames: list) -> bool:
    """Whether one sampled stack (outermost frame first) is a thread waiting, off the CPU."""
    return any(IDLE.search(f) for f in frames[-4:])


def where(frames: list) -> str:
    """The place of one sampled stack (outermost frame first)."""
    for what, pattern in C_PLACES:
        if any(re.search(pattern, f) for f in frames[-4:]):
            return what
    for frame in reversed(frames):
        for pattern, what in _COMPILED:
            if pattern.search(frame):
                return what
        if _PYTHON.search(frame) and not frame.startswith("Thread."):
            return place(frame)
    return "C with no Python frame (uvloop, gloo, torch threads)"


def place(frame: str) -> str:
    for what, pattern in PLACES:
        if re.search(pattern, frame):
            return what
    return "other"


def thread_kind(name: str) -> str:
    """``poseidon-compute_0`` -> ``compute``: the trainer's threads by their job; gloo's C++
    threads (``gloo_tcp_loop``, ``pt_gloo_runloop``) are ``gloo``."""
    if "gloo" in name:
        return "gloo"
    name = re.sub(r"_\d+$", "", name)
    return {"MainThread": "main"}.get(name, name.removeprefix("poseidon-"))


def read(path: str) -> collections.Counter:
    """``Counter((thread kind, place): samples)`` of one raw py-spy file (one line a stack), the
    samples of waiting threads left out."""
    samples: collections.Counter = collections.Counter()
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            if len(frames) < 2 or not count.isdigit() or not frames[0].startswith("thread ") or idle(frames[1:]):
                continue
            samples[(thread_kind(frames[0].partition(": ")[2]), where(frames[1:]))] += int(count)
    return samples


def cells_of(paths: list, steps: int) -> tuple:
    """``({(thread, place): ms of CPU a step and rank}, {"read"|"write": system calls})``: each
    thread's CPU as /proc counted it, shared out over places as py-spy's samples of that thread fall."""
    samples: collections.Counter = collections.Counter()
    spent: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for path in paths:
        samples.update(read_libraries(path) if path.endswith(".perf") else read(path))
        with open(path + ".cpu.json") as f:
            got = json.load(f)
        calls.update(got.pop("syscalls", {}))
        spent.update(got)
    scale = 1e3 / steps / len(paths)
    out: collections.Counter = collections.Counter()
    for thread, seconds in spent.items():
        mine = {p: n for (t, p), n in samples.items() if t == thread}
        if not mine:  # never sampled: gloo's and torch's own threads when not --native; with perf, a
            # window shorter than perf takes to attach
            mine = {
                UNSAMPLED if paths[0].endswith(".perf") else "C with no Python frame (uvloop, gloo, torch threads)": 1
            }
        for p, n in mine.items():
            out[(thread, p)] += seconds * n / sum(mine.values()) * scale
    return out, calls


def table(paths: list, steps: int) -> str:
    """Milliseconds of CPU a step and rank, by place (rows) and thread (columns)."""
    cells, calls = cells_of(paths, steps)
    spent = collections.Counter()
    for (t, _), v in cells.items():
        spent[t] += v
    threads = [t for t, v in spent.most_common() if v >= 0.05]
    cells = {(t if t in threads else "other threads", p): v for (t, p), v in cells.items()}
    threads += ["other threads"] if any(t == "other threads" for t, _ in cells) else []
    places = sorted({p for _, p in cells}, key=lambda p: -sum(v for (_, q), v in cells.items() if q == p))
    total = sum(cells.values()) or 1.0
    lines = ["| where | " + " | ".join(threads) + " | all | share |", "|---|" + "---|" * (len(threads) + 2)]
    for p in places:
        row = [cells.get((t, p), 0.0) for t in threads]
        lines.append(
            f"| {p} | " + " | ".join(f"{x:.2f}" for x in row) + f" | {sum(row):.2f} | {sum(row) / total:.0%} |"
        )
    cols = [sum(v for (t, _), v in cells.items() if t == u) for u in threads]
    lines.append("| **all** | " + " | ".join(f"{x:.2f}" for x in cols) + f" | {total:.2f} | |")
    per = steps * len(paths)
    lines.append(f"\nSystem calls a step and rank: {calls['read'] / per:.0f} reads, {calls['write'] / per:.0f} writes")
    return "\n".join(lines)


def by_run(runs: dict) -> str:
    """One table for several runs of ours: ms of CPU a step and rank by place (rows), every thread
    together, a run a column; under it DDP's whole CPU in the same set-up where it ran."""
    ours = {run: paths for run, paths in runs.items() if not run.startswith("ddp-")}
    cols = {run: cells_of(paths, _steps(run))[0] for run, paths in ours.items()}
    by_place = {run: collections.Counter() for run in cols}
    for run, got in cols.items():
        for (_, p), v in got.items():
            by_place[run][p] += v
    places = sorted({p for c in by_place.values() for p in c}, key=lambda p: -sum(c[p] for c in by_place.values()))
    names = [re.sub(r"^[^-]+-|-\d+steps(\.perf)?$", "", run) for run in cols]  # an impl's name has no "-"
    lines = ["| where | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for p in places:
        lines.append(f"| {p} | " + " | ".join(f"{by_place[run][p]:.2f}" for run in cols) + " |")
    lines.append("| **all** | " + " | ".join(f"**{sum(by_place[run].values()):.2f}**" for run in cols) + " |")
    interpreter = LIBRARIES[0][0]
    if any(interpreter in c for c in by_place.values()):  # perf's: the floor, were the loop's Python all compiled
        rest = [sum(by_place[run].values()) - cols[run].get(("loop", interpreter), 0.0) for run in cols]
        lines.append("| all but the loop's interpreter | " + " | ".join(f"{x:.2f}" for x in rest) + " |")
    ddp = []
    for run in cols:
        twin = re.sub(r"^[^-]+-", "ddp-", run)  # a variant too: poseidon_merge=none-...
        ddp.append(f"{sum(cells_of(runs[twin], _steps(twin))[0].values()):.2f}" if twin in runs else "-")
    lines.append("| DDP's, all | " + " | ".join(ddp) + " |")
    return "\n".join(lines)


def _steps(run: str) -> int:
    return int(re.search(r"-(\d+)steps(\.perf)?$", run).group(1))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench profile", description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="the folder bench train --profile wrote")
    parser.add_argument(
        "--by-run", action="store_true", help="one table: places by our runs, every thread together, DDP's total under"
    )
    args = parser.parse_args(argv)
    runs = collections.defaultdict(list)
    for path in sorted(
        glob.glob(os.path.join(args.dir, "*-rank*.txt")) + glob.glob(os.path.join(args.dir, "*-rank*.perf"))
    ):
        name = os.path.basename(path)  # (perf's runs keep their suffix: a folder may hold both)
        runs[re.sub(r"-rank\d+(?:\.txt|(\.perf))$", r"\1", name)].append(path)
    if args.by_run:
        print(f"ms of CPU a step and rank, sampled\n\n{by_run(runs)}")
        return
    for run, paths in runs.items():
        print(f"\n{run}: ms of CPU a step and rank, sampled ({len(paths)} ranks)\n{table(paths, _steps(run))}")


if __name__ == "__main__":
    main()
