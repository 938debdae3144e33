"""bench profile's reading of py-spy's raw stacks and its apportioning of each thread's CPU."""

import json
import threading

from bench import profile


def _write(tmp_path, name, lines, cpu):
    path = tmp_path / name
    path.write_text("".join(f"{line}\n" for line in lines))
    (tmp_path / f"{name}.cpu.json").write_text(json.dumps(cpu))
    return str(path)


def test_places_and_threads_from_raw_stacks(tmp_path):
    path = _write(
        tmp_path,
        "poseidon-resnet-1gbit-replayed-2w-10steps-rank0.txt",
        [
            "thread (11): poseidon-loop;Thread.run (threading.py:982);run_forever (uvloop/loop.so) 1",
            "thread (11): poseidon-loop;Thread.run (threading.py:982);epoll_pwait (libc.so.6) 5",  # waiting
            "thread (11): poseidon-loop;Thread.run (threading.py:982);Future.set_result "
            "(concurrent/futures/_base.py:540);sem_post (libc.so.6) 5",
            "thread (12): poseidon-compute_0;_worker (concurrent/futures/thread.py:81);_queue_SimpleQueue_get "
            "(_queuemodule.c.h:177);PyThread_acquire_lock_timed (libpython3.11.so.1.0);0x7f16 (libc.so.6) 9",
            "thread (11): poseidon-loop;Thread.run (threading.py:982);Connection.buffer_updated "
            "(poseidon_aio/net/connection.py:301);PyArray_NewFromDescr (numpy/_multiarray_umath.so) 2",
            "thread (12): poseidon-compute_0;run (x.py:1);_engine_run_backward (torch/autograd/graph.py:979) 4",
            'process 9:"python -m bench";thread (12): poseidon-compute_0;a (b.py:1);_worker '
            "(concurrent/futures/thread.py:81) 1",  # --subprocesses output, not a Sampler's: skipped
            "garbage",
        ],
        {"loop": 0.08, "compute": 0.05, "gloo_tcp_loop": 0.01},
    )
    got = profile.read(path)
    assert ("loop", "event loop: epoll") not in got  # off the CPU: not a share of its time
    assert got[("loop", "executor hops and futures")] == 5
    assert not any(t == "compute" and "executor" in p for t, p in got)
    assert got[("loop", "C with no Python frame (uvloop, gloo, torch threads)")] == 1
    assert got[("loop", "receive path (Connection)")] == 2  # NumPy's C counts where it was called
    assert got[("compute", "autograd and torch ops")] == 4
    assert sum(got.values()) == 12  # the malformed line and the process-first line are not counted

    text = profile.table([path], steps=10)
    rows = {r.split(" | ")[0].strip("| "): r for r in text.splitlines()}
    # the loop's 8 ms a step split 5:1:2 by its samples; a thread never sampled kept whole
    assert " 5.00 " in rows["executor hops and futures"]
    assert " 2.00 " in rows["receive path (Connection)"]
    assert " 2.00 " in rows["C with no Python frame (uvloop, gloo, torch threads)"]
    assert rows["**all**"].split(" | ")[-2].strip() == "14.00"


def test_the_compiled_receive_core_is_the_receive_path_up_to_a_python_callback():
    loop = ["Thread.run (threading.py:982)", "run_forever (uvloop/loop.so)"]
    core = "__pyx_pw_ReceiveCore_buffer_updated (poseidon_aio/net/_creceive.cpython-311-x86_64-linux-gnu.so)"
    decoder = "__pyx_f_FrameDecoder_next_frame (poseidon_aio/wire/_ccodec.cpython-311-x86_64-linux-gnu.so)"
    assert profile.where([*loop, core, decoder, "_PyObject_Malloc (libpython3.11.so.1.0)"]) == (
        "receive path (Connection)"
    )
    assert profile.where([*loop, core, "KVShard._on_frame (poseidon_aio/ps/shard.py:248)"]) == (
        "shard aggregation (PS server)"
    )
    tally = "__pyx_f_Tally__arrived (poseidon_aio/ps/_ctally.cpython-311-x86_64-linux-gnu.so)"
    assert profile.where([*loop, core, tally, "_PyObject_Malloc (libpython3.11.so.1.0)"]) == (
        "shard aggregation (PS server)"
    )
    twin = "ReceiveCore.buffer_updated (poseidon_aio/net/receive.py:70)"
    assert profile.where([*loop, twin, "Endpoint._to_inbox (poseidon_aio/net/endpoint.py:280)"]) == (
        "frame dispatch (Endpoint)"
    )
    assert profile.where([*loop, twin]) == "receive path (Connection)"


def test_thread_cpu_names_this_thread():
    mine = threading.get_native_id()
    got = profile.thread_cpu()
    assert got[mine][0] == threading.current_thread().name
    assert got[mine][1] >= 0.0 and got[mine][2] >= 0
    assert profile.thread_kind("poseidon-compute_0") == "compute" and profile.thread_kind("MainThread") == "main"


def test_by_run_puts_ddps_total_under_a_variant_of_ours_too(tmp_path):
    stack = "thread (11): poseidon-loop;Thread.run (threading.py:982);run_forever (uvloop/loop.so) 1"
    runs = {}
    for impl, cpu in (("ddp", 0.02), ("poseidon_merge=none", 0.05)):
        run = f"{impl}-resnet-1gbit-replayed-2w-10steps"
        runs[run] = [_write(tmp_path, f"{run}-rank0.txt", [stack], {"loop": cpu})]
    lines = profile.by_run(runs).splitlines()
    assert lines[0] == "| where | resnet-1gbit-replayed-2w |"
    assert lines[-2] == "| **all** | **5.00** |" and lines[-1] == "| DDP's, all | 2.00 |"


def test_perf_samples_by_library_and_the_floor_without_the_loops_interpreter(tmp_path):
    script = "\n".join(
        [
            "   11  7f2560 (/venv/lib/python3.11/site-packages/uvloop/loop.cpython-311-x86_64-linux-gnu.so)",
            "   11  7f2561 (/usr/lib/libpython3.11.so.1.0)",
            "   11  7f2562 (/usr/lib/libpython3.11.so.1.0)",
            "   11  ffffffff81b6 ([kernel.kallsyms])",
            "   12  7f2563 (/venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so)",
            "   12  7f2564 (/venv/lib/python3.11/site-packages/poseidon_aio/net/_creceive.cpython-311.so)",
            "not a sample",
        ]
    )
    lines = profile.perf_lines(script, {11: "poseidon-loop", 12: "MainThread"})
    assert len(lines) == 5 and lines[0].endswith("libpython3.11.so.1.0 2\n")
    run = "poseidon-cnn-100mbit-replayed-2w-10steps.perf"
    path = tmp_path / "poseidon-cnn-100mbit-replayed-2w-10steps-rank0.perf"
    path.write_text("".join(lines) + "garbage\n")
    (tmp_path / f"{path.name}.cpu.json").write_text(json.dumps({"loop": 0.04, "main": 0.02, "syscalls": {}}))
    got = profile.read_libraries(str(path))
    assert got[("loop", "CPython's interpreter (libpython)")] == 2 and got[("loop", "uvloop")] == 1
    assert got[("main", "our compiled parts (codec, receive core, tally)")] == 1 and sum(got.values()) == 6
    ddp = tmp_path / "ddp-cnn-100mbit-replayed-2w-10steps-rank0.perf"
    ddp.write_text("thread (13): gloo_tcp_loop;[kernel.kallsyms] 3\n")
    (tmp_path / f"{ddp.name}.cpu.json").write_text(json.dumps({"gloo": 0.03}))
    lines = profile.by_run({run: [str(path)], "ddp-cnn-100mbit-replayed-2w-10steps.perf": [str(ddp)]}).splitlines()
    assert lines[0] == "| where | cnn-100mbit-replayed-2w |"
    # the loop's 4 ms a step split 2:1:1; the main thread's 2 ms 1:1; the floor is 6 - 2
    assert "| CPython's interpreter (libpython) | 2.00 |" in lines
    assert lines[-3:] == [
        "| **all** | **6.00** |",
        "| all but the loop's interpreter | 4.00 |",
        "| DDP's, all | 3.00 |",
    ]


def test_a_thread_perf_never_sampled_is_said_so(tmp_path):
    path = tmp_path / "poseidon-cnn-1gbit-replayed-2w-10steps-rank0.perf"
    path.write_text("")  # perf attached after a window this short was over
    (tmp_path / f"{path.name}.cpu.json").write_text(json.dumps({"loop": 0.01}))
    cells, _ = profile.cells_of([str(path)], steps=10)
    assert cells == {("loop", profile.UNSAMPLED): 1.0}
