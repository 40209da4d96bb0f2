"""What decides how the nvshmem backend's calls run from CUDA graphs (moe_comm.kernels.call_graphs),
on CPU: when graphs are off, what a graph is keyed by, and a layer's instances: replayed for a
call whose inputs sit where the graph reads them, never while an output of theirs is alive,
bounded in number, given up when the inputs never settle. A stand-in for the CUDA graph reads
its inputs where they are and rewrites its outputs on every replay, as a captured graph does;
that graphed calls equal eager ones on the GPU is tests/gpu/nvshmem_cases.py's
`graphed_calls_match_eager`."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_comm.kernels import call_graphs
from moe_comm.kernels.call_graphs import CallGraphs


class StandInCapture:
    """capture(fn) runs fn once for its outputs (the graph's own memory); replay runs it again
    and writes the result into those same outputs."""

    def __init__(self):
        self.captures = 0
        self.replays = 0

    def capture(self, fn):
        self.captures += 1
        outputs = fn()
        return (fn, outputs), outputs

    def replay(self, graph):
        self.replays += 1
        fn, outputs = graph
        fresh = fn()
        for static, new in zip(call_graphs._flat(outputs), call_graphs._flat(fresh)):
            static.copy_(new)


def op(x, w, shape):
    """Two outputs, like the real ops: rows scaled by w, and a per-row sum."""
    return x * w[:, None] * shape[0], x.sum(dim=1)


def expected(x, w, shape):
    return op(x.clone(), w.clone(), shape)


def test_graphs_are_off_where_asked_or_not_on_cuda():
    assert call_graphs.reason_off(torch.device("cuda"), True) == ""
    assert "[moe_comm] cuda_graphs = false" in call_graphs.reason_off(torch.device("cuda"), False)
    assert "not CUDA" in call_graphs.reason_off(torch.device("cpu"), True)
    assert "[moe_comm] cuda_graphs = false" in call_graphs.summary([], False)


def test_the_op_itself_runs_under_a_dispatch_mode(monkeypatch):
    """Selective activation checkpointing sees ops through a dispatch mode: a replay would hide
    the call from it, so the op runs as it is there."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert call_graphs.op_itself_because() == ""
    with TorchDispatchMode():
        assert "dispatch mode" in call_graphs.op_itself_because()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert call_graphs.op_itself_because() == "inside another CUDA graph capture"  # a caller's own capture


def test_the_footer_line_says_how_the_calls_ran():
    a, b = CallGraphs("a", StandInCapture()), CallGraphs("b", StandInCapture())
    a.counts.update({"replayed": 90, "captured": 4, "op itself, under a dispatch mode (selective activation "
                     "checkpointing's)": 6})
    b.counts.update({"replayed": 10, "captured": 2, "eager": 3})
    b.stopped = "its calls' inputs did not settle"
    line = call_graphs.summary([a, b], True)
    assert line.startswith("100 of 115 MoE calls replayed from CUDA graphs (6 captured, 6 op itself, under a dispatch")
    assert line.endswith("3 eager: its calls' inputs did not settle)")
    assert call_graphs.summary([], True).startswith("MoE calls ran without CUDA graphs")


def test_key_is_every_input_where_it_sits():
    x, w = torch.randn(4, 8), torch.randn(4)
    k = call_graphs.key("op", (x, w, 7, [1, 2]))
    assert k == call_graphs.key("op", (x, w, 7, [1, 2]))
    assert k == call_graphs.key("op", (x.view(4, 8), w, 7, [1, 2]))  # same memory, same layout
    assert k != call_graphs.key("op", (x.clone(), w, 7, [1, 2]))  # moved
    assert k != call_graphs.key("op", (x[:2], w, 7, [1, 2]))  # same address, other shape
    assert k != call_graphs.key("op", (x.view(8, 4), w, 7, [1, 2]))
    assert k != call_graphs.key("op", (x, w, 8, [1, 2]))
    assert k != call_graphs.key("op", (x, w, 7, [1, 3]))
    assert k != call_graphs.key("other", (x, w, 7, [1, 2]))
    assert k != call_graphs.key("op", (x.double(), w, 7, [1, 2]))


def test_a_call_at_the_same_addresses_replays_with_fresh_values():
    cap = StandInCapture()
    graphs = CallGraphs("test layer", cap)
    x, w = torch.randn(16, 8), torch.randn(16)
    for i in range(6):
        x.copy_(torch.randn(16, 8))  # fresh routing and rows, same memory: a training step's pattern
        w.copy_(torch.randn(16))
        out = graphs.call(op, (x, w, [3]))
        for got, want in zip(out, expected(x, w, [3])):
            assert torch.equal(got, want), f"call {i}"
        del out, got  # the step ends: nothing of this call is kept
    assert graphs.counts == {"captured": 1, "replayed": 5} and cap.replays == 6  # first call: capture, then replay


def test_outputs_still_alive_are_never_rewritten():
    """An activation kept for the backward (or by another microbatch) pins its instance: the
    same key gets a second one, and the first call's values stay as they were."""
    graphs = CallGraphs("test layer", StandInCapture())
    x, w = torch.randn(16, 8), torch.randn(16)
    first = graphs.call(op, (x, w, [2]))
    kept = [t.clone() for t in first]
    x.copy_(torch.randn(16, 8))
    second = graphs.call(op, (x, w, [2]))
    assert all(torch.equal(a, b) for a, b in zip(first, kept)), "a live output was rewritten"
    assert all(torch.equal(a, b) for a, b in zip(second, expected(x, w, [2])))
    assert graphs.counts["captured"] == 2 and sum(len(v) for v in graphs.instances.values()) == 2
    saved = first[1][:3]  # a view of one output keeps its instance busy too
    del first
    x.copy_(torch.randn(16, 8))
    third = graphs.call(op, (x, w, [2]))
    assert graphs.counts["captured"] == 3 and torch.equal(saved, kept[1][:3])
    del second, third, saved
    graphs.call(op, (x, w, [2]))
    assert graphs.counts["replayed"] == 1  # once nothing is alive, an instance serves again


def test_instances_are_bounded_and_the_least_recently_used_idle_one_goes():
    graphs = CallGraphs("test layer", StandInCapture())
    w = torch.randn(4)
    inputs = [torch.randn(4, 8) for _ in range(call_graphs.MAX_INSTANCES + 3)]  # each its own address
    for x in inputs:
        graphs.call(op, (x, w, [1]))
    assert sum(len(v) for v in graphs.instances.values()) == call_graphs.MAX_INSTANCES
    assert graphs.counts["dropped"] == 3
    assert call_graphs.key(str(op), (inputs[0], w, [1])) not in graphs.instances  # the oldest went
    assert call_graphs.key(str(op), (inputs[-1], w, [1])) in graphs.instances


def test_every_instance_busy_runs_the_op_itself():
    graphs = CallGraphs("test layer", StandInCapture())
    w = torch.randn(4)
    inputs = [torch.randn(4, 8) for _ in range(call_graphs.MAX_INSTANCES + 1)]
    kept = [graphs.call(op, (x, w, [1])) for x in inputs]
    assert graphs.counts["eager"] == 1 and graphs.counts["captured"] == call_graphs.MAX_INSTANCES
    for x, out in zip(inputs, kept):
        assert all(torch.equal(a, b) for a, b in zip(out, expected(x, w, [1])))


def test_a_layer_whose_inputs_never_settle_stops_capturing(capsys):
    graphs = CallGraphs("layer 3", StandInCapture())
    w = torch.randn(4)
    moving = []  # every call's input at a new address
    for _ in range(call_graphs.MAX_CAPTURES + 5):
        moving.append(torch.randn(4, 8))
        out = graphs.call(op, (moving[-1], w, [1]))
        assert all(torch.equal(a, b) for a, b in zip(out, expected(moving[-1], w, [1])))
        del out
    assert graphs.stopped and graphs.counts["captured"] == call_graphs.MAX_CAPTURES
    assert graphs.counts["eager"] == 5 and not graphs.instances
    assert "layer 3: MoE calls run without CUDA graphs from now on" in capsys.readouterr().err


@pytest.mark.parametrize("as_tuple", [True, False])
def test_aliases_hold_their_storage(as_tuple):
    t = torch.zeros(3)
    storage = t.untyped_storage()
    before = call_graphs._uses(storage)
    alias = call_graphs._aliases((t,), as_tuple)
    assert call_graphs._uses(storage) == before + 1
    del alias
    assert call_graphs._uses(storage) == before
