"""The profiler timeline: a tiny hand-written Chrome trace, then a real one from the worker."""

import gzip
import json

import matplotlib
import pytest

matplotlib.use("Agg")

from tutorial_utils.bench import timeline  # noqa: E402

HOST, GPU = 100, 0  # a process id and a device index, as torch.profiler writes them


def _x(cat, name, ts, dur, pid=HOST, tid=HOST):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}


def tiny_gpu_trace() -> list[dict]:
    """Two steps of 1000 us: compute on stream 7 for 800 us, NCCL on stream 20 for 400 us,
    of which the first 200 run beside compute and the last 200 after it."""
    events = [{"ph": "M", "name": "thread_name", "pid": HOST, "tid": HOST,
               "args": {"name": "thread 100 (python)"}},
              {"ph": "M", "name": "thread_name", "pid": GPU, "tid": 7,
               "args": {"name": "stream 7 "}}]
    for k in range(2):
        t = 1000 * k
        events += [_x("user_annotation", f"step {k}", t, 50),
                   _x("cuda_runtime", "cudaGraphLaunch", t, 20),
                   _x("cpu_op", "aten::empty", t + 20, 5),
                   _x("user_annotation", "nccl:all_reduce", t + 30, 5),  # host side: not drawn
                   _x("kernel", "sm90_xmma_conv", t, 500, GPU, 7),
                   _x("kernel", "triton_poi_fused_add", t + 500, 300, GPU, 7),
                   _x("gpu_memcpy", "Memcpy DtoD", t + 800, 10, GPU, 7),
                   _x("kernel", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", t + 600, 400, GPU, 20),
                   _x("gpu_user_annotation", f"step {k}", t, 1000, GPU, 7)]  # not a kernel
    return events


def test_events_are_sorted_into_the_legends_categories():
    trace = tiny_gpu_trace()
    assert [timeline.category(e) for e in trace[2:11]] == [
        None, timeline.LAUNCHES, timeline.HOST_OPS, None, timeline.COMPUTE, timeline.COMPUTE,
        timeline.COPIES, timeline.NCCL, None]
    rows = timeline.rows(trace)
    assert list(rows) == ["host: main thread", "GPU 0, stream 7", "GPU 0, stream 20"]
    assert len(rows["GPU 0, stream 7"]) == 6 and len(rows["GPU 0, stream 20"]) == 2
    assert timeline.step_starts(trace) == [0, 1000]


def test_overlap_per_step_of_nccl_and_compute():
    got = timeline.overlap(tiny_gpu_trace())
    assert got["steps"] == 2 and got["comm"] == timeline.NCCL
    assert got["comm_ms"] == pytest.approx(0.4)
    assert got["compute_ms"] == pytest.approx(0.8)
    assert got["overlap_ms"] == pytest.approx(0.2)
    assert got["exposed_ms"] == pytest.approx(0.2)
    assert got["overlap_frac"] == pytest.approx(0.5)


def test_the_plot_has_a_row_per_stream_and_a_legend_entry_per_drawn_kind(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": tiny_gpu_trace()}, f)
    fig = timeline.plot(timeline.load(path), "tiny")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == list(timeline.rows(tiny_gpu_trace()))
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == [timeline.HOST_OPS, timeline.LAUNCHES, timeline.COMPUTE, timeline.NCCL,
                      timeline.COPIES, "a step starts (host)"]
    assert ax.get_xlabel().endswith("(ms)")
    assert ax.get_xlim()[1] >= 2.0  # two steps of 1 ms each


def test_a_trace_from_the_worker_on_two_cpu_processes(tmp_path):
    trace = tmp_path / "trace.json"
    from tutorial_utils.bench.ddp_timing import trace as ddp_trace
    from tutorial_utils.bench.workload import Workload

    row = ddp_trace(Workload("wrn-10-1", 2, 1, 1), 2, "cpu", False, trace)
    assert row.world_size == 2 and row.all_reduces >= 1 and row.no_sync_ms > 0
    events = timeline.load(trace)
    rows = timeline.rows(events)
    assert next(iter(rows)) == "host: main thread"  # whatever the interpreter is called
    assert any(c == timeline.GLOO for spans in rows.values() for _, _, c in spans)
    assert len(timeline.step_starts(events)) == 5
    got = timeline.overlap(events)
    assert got["comm"] == timeline.GLOO and got["comm_ms"] > 0
    assert 0 <= got["overlap_ms"] <= got["comm_ms"]
    timeline.plot(events, "WRN-10-1 on two CPU processes")


@pytest.mark.parametrize("interpreter", ["python", "python3", "python3.12"])
def test_the_main_thread_is_labelled_whatever_the_interpreter_is_called(interpreter):
    trace = tiny_gpu_trace()
    trace[0]["args"]["name"] = f"thread 100 ({interpreter})"
    assert next(iter(timeline.rows(trace))) == "host: main thread"
