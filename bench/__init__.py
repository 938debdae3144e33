"""Benchmarks: ``python -m bench <name>``."""

from poseidon_aio.cluster.launcher import free_port
from poseidon_aio.plan.merging import BEST_PLANNERS, MergeConfig

# The token the bench's local workers share (handed over in their environment, as a launcher would).
BENCH_TOKEN = "bench-local-job-token-0123456789abcdef"


# Untimed steps before a bench times ours: the measured ones and the planning step, then every plan
# ``best`` can try and one message per layer again (the trial's control), a trial's steps each.
MERGE_WARMUP = MergeConfig.after + 1 + (len(BEST_PLANNERS) + 1) * MergeConfig.trial


def parse_impl(impl: str, settings: dict) -> tuple:
    """``"poseidon:chunk=262144:merge=single"`` -> ``("poseidon", {"chunk": "262144", ...})``: an
    implementation with settings of its own, so that variants run interleaved with the rest in one
    run. ``settings``: ``{mode: the setting names it takes}``, every mode a bench runs.

    Raises:
        SystemExit: a mode not in ``settings``, or a setting it does not take (before any run).
    """
    mode, *given = impl.split(":")
    variant = dict(s.split("=", 1) for s in given if "=" in s)
    if mode not in settings or len(variant) < len(given) or set(variant) - settings[mode]:
        takes = "; ".join(
            f"{m}" + (f" with {', '.join(f'{s}=' for s in sorted(names))}" if names else "")
            for m, names in settings.items()
        )
        raise SystemExit(f"--impls: {impl!r} is not one of: {takes}")
    return mode, variant


def rank_env(rank: int, world: int, port: int, master: str = "127.0.0.1") -> dict:
    """What a launcher gives rank ``rank`` of a local job: its place, the rendezvous, the token."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
        "POSEIDON_TOKEN": BENCH_TOKEN,
    }


def launch(module: str, world: int, cfg: dict, *, namespaces=None, timeout: float = 900, what: str = "") -> list:
    """Run ``python -m <module> --worker <cfg>`` as ``world`` ranks of one job (each in its
    namespace when given, as ``ip netns exec`` does), and return each rank's JSON result.

    Every rank gets the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, the
    job's token) and ``cfg`` plus ``rank``, ``world`` and ``out`` (the file it writes its result to).
    """
    import json
    import os
    import subprocess
    import sys
    import tempfile
    import time

    port = free_port()
    master = "10.77.0.1" if namespaces else "127.0.0.1"
    # A worker's stderr goes to a file, not a pipe nobody reads until the end (a worker that
    # logs more than the pipe holds would block until the timeout); the folder goes with the run.
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        procs, outs, errs = [], [], []
        try:
            for rank in range(world):
                out = os.path.join(tmp, f"rank{rank}.json")
                outs.append(out)
                env = {
                    **os.environ,
                    **rank_env(rank, world, port, master),
                    "OMP_NUM_THREADS": "1",
                    "GLOO_SOCKET_IFNAME": "eth0" if namespaces else "lo",
                    "PYTHONPATH": os.getcwd(),
                }
                command = [
                    sys.executable,
                    "-m",
                    module,
                    "--worker",
                    json.dumps({**cfg, "rank": rank, "world": world, "out": out}),
                ]
                if namespaces:
                    command = ["ip", "netns", "exec", namespaces[rank], *command]
                errs.append(open(os.path.join(tmp, f"rank{rank}.err"), "w+"))
                procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=errs[-1]))
            deadline = time.monotonic() + timeout
            for p in procs:
                try:
                    p.wait(timeout=max(1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"{what or module} did not finish within {timeout} s") from None
            failed = [(rank, p) for rank, p in enumerate(procs) if p.returncode != 0]
            if failed:
                # Every failed rank's last lines: the first one is often only a peer's victim.
                def tail(rank: int) -> str:
                    errs[rank].seek(0)
                    return errs[rank].read()[-1500:]

                tails = "\n".join(f"rank {rank}: ...{tail(rank)}" for rank, _ in failed)
                raise RuntimeError(f"{what or module} failed on ranks {[r for r, _ in failed]}:\n{tails}")
            results = []
            for out in outs:
                with open(out) as f:
                    results.append(json.load(f))
            return results
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for f in errs:
                f.close()


def median_run(runs: list) -> dict:
    """The run whose step time is the median of the repeats (the lower one of an even count)."""
    return sorted(runs, key=lambda r: r["step_s"])[(len(runs) - 1) // 2]


def job_cpu(ranks: list) -> float:
    """CPU seconds a step, every thread of each worker process (gloo's included), summed over ranks:
    what the job asks of the host's cores each step. Each rank's ``"cpu"`` holds its timed steps'
    back-to-back ``process_time`` deltas; their mean is the rank's CPU over the timed steps ÷ steps.

    The mean, not the median: ``process_time`` counts another thread's CPU only up to its last
    sleep or scheduler tick, so what a thread still running on the other core at a step's end has
    spent (gloo's, finishing the all-reduce after waking the step) lands in a later step's delta,
    in lumps. The median of the deltas drops the lumps; their sum over the back-to-back timed steps
    keeps them (bench/RESULTS.md, bench train)."""
    return sum(sum(r["cpu"]) / len(r["cpu"]) for r in ranks)
