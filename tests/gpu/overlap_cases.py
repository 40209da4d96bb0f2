"""GPU cases of the MoE comm overlap (moe_comm.titan.overlap), shared by the backends' case
runners (tests/gpu/nvshmem_cases.py, tests/gpu/deepep_cases.py): what the CPU tests cannot
check, because CPU ops have no streams.

- `calls_in_flight`: a backend's real calls in the "chunked" schedule, by hand: two dispatches
  in flight on the process's comm stream, each chunk's experts on the compute stream (kept busy
  with a GEMM) while the other chunk's dispatch or combine runs, every ordering by events only,
  no host sync inside an iteration; many iterations with fresh routing, each output against the
  pure-torch reference (tests/gpu/oracles.py).
- `layer_matches_plain`: TorchTitan's debug model (one dense and two MoE layers, every MoE layer
  on the backend, expert weights sharded over the ranks) trained one step with overlap "chunked"
  and with "none" from the same weights, with activation checkpointing none, full and per-op
  selective: the loss and every gradient agree, and the backend's dispatch and combine are called
  once per layer and chunk in a step, whatever the AC mode (the recompute replays them:
  moe_comm.titan.recompute). fp32 with
  the for-loop experts: 1e-4 (the expert weights' gradient is a sum over two chunks); bf16
  grouped GEMMs: 2e-2 of each gradient's largest value (each chunk's expert-weight gradient is
  rounded to bf16 on its own). The metrics' waits were recorded in forward and backward.

- `microbatch_calls_in_flight`: the overlap across microbatches (DualPipeV's, and overlap
  "microbatch": moe_comm.titan.pipeline) by hand: one microbatch's forward calls (dispatch,
  experts, combine through the handoffs with TorchTitan's sync points) in this thread while
  another's backward (combine's and dispatch's backwards) runs in a second thread on the same
  compute stream, both meeting at the sync points, the comm on the process's comm stream; many
  iterations with fresh routing; the forward's output and the backward's gradients (x and the
  routing weights) against the pure-torch reference (tests/gpu/oracles.py).
- `microbatch_layer_matches_plain`: the debug model with sync points on both MoE layers, two
  microbatches: one's forward beside the other's backward in two threads (as torch's
  OVERLAP_F_B runs them under TorchTitan's callback), against forward, backward, forward,
  backward in one thread, with activation checkpointing none and full (the backward thread's
  recompute passes no sync point and calls no comm op), and with overlap "none" and "chunked"
  (DualPipeV's overlap with the chunked one outside its pairs: the first microbatch's forward
  runs outside the pair, chunked, and its backward in the pair): the losses and the accumulated
  gradients agree (tolerances as above), the threads met at every sync point, and dispatch and
  combine ran once per layer, microbatch and chunk.

All also run on CPU with the nccl backend (tests/test_overlap.py), where every stream
operation is a no-op: that checks the cases themselves, not the streams.
"""

import copy
import threading

import torch

from oracles import expert_params, reference_forward

from moe_comm.backends.base import chunk_sizes
from moe_comm.titan import overlap

MODES = ("random", "zipf", "one_expert")


def _experts_by_row(recv_RD, tokens_per_expert_L, first_expert, a, b):
    """y = recv * a_e + b_e on each expert's segment (as oracles.apply_experts), rows past the
    last segment zero, without reading the counts on the host (no sync inside the schedule)."""
    L = tokens_per_expert_L.numel()
    ends_L = tokens_per_expert_L.to(device=recv_RD.device, dtype=torch.int64).cumsum(0)  # DeepEP's are on the host
    row_R = torch.arange(recv_RD.shape[0], device=recv_RD.device)
    e_R = torch.searchsorted(ends_L, row_R, right=True)
    valid_R = (e_R < L)[:, None]
    e_R = e_R.clamp(max=L - 1) + first_expert
    return torch.where(valid_R, recv_RD * a[e_R] + b[e_R], torch.zeros((), dtype=recv_RD.dtype, device=recv_RD.device))


def calls_in_flight(rank, world, device, route, backend, hidden, num_experts, top_k, iters, min_tokens=1,
                    dtype=torch.bfloat16):
    s = overlap.Streams(device)  # the process's comm stream and the current one (no-ops on CPU)
    L = num_experts // world
    a, b = expert_params(num_experts, hidden, dtype, device, 21)
    busy = torch.randn(*(2 * (1024 if s.cuda else 32,)), device=device, dtype=torch.bfloat16)
    errors = []
    for it in range(iters):
        g = torch.Generator().manual_seed(900 + it * 31 + rank)
        T = min_tokens + (it * 97 + rank * 13) % 512  # 1 token: the second chunk is empty
        x = torch.randn(T, hidden, generator=g).to(dtype).to(device)
        idx, w = route(T, num_experts, top_k, MODES[it % len(MODES)], g)
        sizes = chunk_sizes(T, 2)
        s.wait(s.comm, s.mark(s.compute))
        dispatched, dispatch_done = [], []
        with s.on_comm():
            for xc, ic, wc in zip(x.split(sizes), idx.split(sizes), w.split(sizes)):
                s.hand_over((xc, ic, wc), s.comm)
                dispatched.append(backend.dispatch(xc.contiguous(), ic.contiguous(), wc.contiguous()))
                dispatch_done.append(s.mark(s.comm))
        outs = []
        for d, done in zip(dispatched, dispatch_done):
            busy = (busy @ busy).tanh()  # the compute stream has work of its own meanwhile
            s.wait(s.compute, done)
            s.hand_over((d.recv_x_RD, d.tokens_per_expert_L), s.compute)
            y = _experts_by_row(d.recv_x_RD, d.tokens_per_expert_L, rank * L, a, b)
            s.wait(s.comm, s.mark(s.compute))
            with s.on_comm():
                s.hand_over((y,), s.comm)
                outs.append(backend.combine(y, d.handle))
        busy = (busy @ busy).tanh()
        s.wait(s.compute, s.mark(s.comm))
        s.hand_over(outs, s.compute)
        out = torch.cat(outs).float().cpu()
        ref = reference_forward(x.cpu(), idx.cpu(), w.cpu(), a.cpu(), b.cpu())
        err = (out - ref).abs().max().item() if T else 0.0
        if err > 3e-2 * max(1.0, ref.abs().max().item()):
            errors.append(f"iteration {it} ({T} tokens): error {err}")
    if s.cuda:
        torch.cuda.synchronize()
    if hasattr(backend, "check_errors"):
        backend.check_errors(synchronize=True)
    assert not errors, errors


def debug_model_args(grouped_mm: bool = False):
    """TorchTitan's debug model cut to one dense and two MoE layers, with its standard MoE (the
    one our layers replace); `grouped_mm` selects the experts' grouped GEMM (GPU only: on CPU
    TorchTitan's for-loop experts run, as update_from_config sets in a run)."""
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    args = copy.deepcopy(deepseekv3_args["debugmodel"])
    args.moe_impl = "standard"
    args.moe_args.use_grouped_mm = grouped_mm
    args.n_layers = 3
    return args


def _model(rank, world, device, make_backend, ac, grouped_mm):
    from torchtitan.config.job_config import ActivationCheckpoint

    from moe_comm.metrics import instrument
    from moe_comm.titan import recompute
    from moe_comm.titan.model import MoECommDeepSeekV3Model

    args = debug_model_args(grouped_mm)
    torch.manual_seed(0)  # the same weights on every rank; each rank keeps its experts' slice
    with torch.device(device):
        model = MoECommDeepSeekV3Model(args)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    backends = []
    for block in model.layers.values():
        if block.moe_enabled:
            experts = block.moe.experts
            L = experts.num_experts // world
            for name in ("w1", "w2", "w3"):
                full = getattr(experts, name)
                setattr(experts, name, torch.nn.Parameter(full.detach()[rank * L:(rank + 1) * L].clone()))
            block.moe.comm_backend = instrument(make_backend(experts.num_experts, block.moe.router.top_k, args.dim))
            backends.append(block.moe.comm_backend)
    if ac != "none":
        mode, option = ac.split(":")
        recompute.apply_ac(model, ActivationCheckpoint(mode=mode, selective_ac_option=option),
                           model_compile_enabled=False, base_folder="")
    return model, backends


def _count_calls(backends) -> dict:
    """Counts the calls of every instrumented backend's own dispatch and combine."""
    calls = {"dispatch": 0, "combine": 0}
    for b in backends:
        for op in calls:
            real = getattr(b.backend, op)

            def counted(*args, _real=real, _op=op):
                calls[_op] += 1
                return _real(*args)

            setattr(b.backend, op, counted)
    return calls


def layer_matches_plain(rank, world, device, make_backend):
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(40 + rank)).to(device)
    failures = []
    for grouped_mm, tol in ((False, 1e-4), (True, 2e-2)):
        for ac in ("none", "full:2", "selective:op"):
            model, backends = _model(rank, world, device, make_backend, ac, grouped_mm)
            calls = _count_calls(backends)
            results, timing, waits = {}, {}, set()
            for mode in ("none", "chunked"):
                for backend in backends:
                    backend.config.overlap = mode
                model.zero_grad(set_to_none=True)
                calls.update(dispatch=0, combine=0)
                loss = model(tokens).float().square().mean()
                loss.backward()
                chunks = 2 if mode == "chunked" else 1
                if calls != {"dispatch": 2 * chunks, "combine": 2 * chunks}:
                    failures.append(f"grouped_mm={grouped_mm} ac={ac} {mode}: calls per step {calls}")
                results[mode] = (loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                              if p.grad is not None})
                if device.type == "cuda":
                    torch.cuda.synchronize()
                for backend in backends:
                    if hasattr(backend.backend, "check_errors"):
                        backend.backend.check_errors(synchronize=True)
                waits |= {phase for phase, _, _ in backends[0].stats.waits}
                times = backends[0].stats.take_times_ms()
                timing[mode] = (sum(times.values()), sum(backends[0].stats.take_exposed_ms(times).values()))
            where = f"grouped_mm={grouped_mm} ac={ac}"
            if device.type == "cuda" and waits != {"dispatch_fwd", "dispatch_bwd", "combine_fwd", "combine_bwd"}:
                failures.append(f"{where}: waits recorded for {sorted(waits)}, not every phase")
            if not (timing["chunked"][1] >= 0 and timing["none"][0] == timing["none"][1]):
                failures.append(f"{where}: comm and exposed ms {timing}")
            if rank == 0:
                print(f"[overlap] {where}: first MoE layer, comm / exposed ms: none {timing['none'][0]:.2f} / "
                      f"{timing['none'][1]:.2f}, chunked {timing['chunked'][0]:.2f} / {timing['chunked'][1]:.2f}",
                      flush=True)
            (loss_plain, grads_plain), (loss_chunked, grads_chunked) = results["none"], results["chunked"]
            if abs(loss_chunked - loss_plain) > tol * max(1.0, abs(loss_plain)):
                failures.append(f"{where}: loss {loss_chunked} vs {loss_plain}")
            if grads_plain.keys() != grads_chunked.keys():
                failures.append(f"{where}: gradients for different parameters")
                continue
            for name, g in grads_plain.items():
                if not torch.isfinite(grads_chunked[name]).all():
                    failures.append(f"{where}: {name} has non-finite gradients")
                    continue
                err = (grads_chunked[name] - g).abs().max().item()
                if err > tol * max(g.abs().max().item(), 1e-6):
                    failures.append(f"{where}: {name} differs by {err} (largest {g.abs().max().item()})")
    assert not failures, "\n".join(failures)


# ---- the overlap across microbatches --------------------------------------------------------------

def _in_two_threads(device, forward, backward, num_layers):
    """`forward()` here and `backward()` in a second thread on the same current stream, meeting
    at the MoE layers' sync points (TorchTitan's coordinator, as its overlap callback runs them);
    (forward's result, sync-point crossings). A failure in either thread ends the other's waits
    and is raised here."""
    from torchtitan.distributed import dual_pipe_v

    coordinator = dual_pipe_v._hook_coordinator
    crossings, errors = [0], []
    barrier = type(coordinator).barrier

    def counting_barrier(self):
        if self.is_coordination_enabled():
            crossings[0] += 1
        return barrier(self)

    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def run_backward():
        try:
            if stream is not None:
                torch.cuda.set_stream(stream)
            backward()
        except BaseException as e:  # noqa: BLE001 - raised in the calling thread below
            errors.append(e)
            coordinator.disable_coordination()

    type(coordinator).barrier = counting_barrier
    coordinator.enable_coordination(num_layers=num_layers)
    try:
        thread = threading.Thread(target=run_backward, daemon=True)
        thread.start()
        try:
            result = forward()
        except BaseException:
            coordinator.disable_coordination()  # the backward thread's waits end
            raise
        finally:
            thread.join(timeout=300)
        if thread.is_alive():
            raise RuntimeError("the backward thread did not finish within 300 s (a sync point never met)")
    finally:
        coordinator.disable_coordination()
        type(coordinator).barrier = barrier
    if errors:
        raise errors[0]
    return result, crossings[0]


def _oracle_layer(s, backend, x, idx, w, first_expert, a, b):
    """overlapped_moe's handoffs and sync points (one chunk) around dispatch, the oracle's
    experts and combine."""
    def handoff(op, point):
        return overlap.Handoff(s, op, point, None)

    with s.on_comm():
        xc, ic, wc = overlap.to_comm(handoff("dispatch", "A"), x, idx, w)
        d = backend.dispatch(xc, ic, wc)
        done = s.mark(s.comm)
    recv, counts = overlap.from_comm(handoff("dispatch", "B"), d.recv_x_RD, d.tokens_per_expert_L, done=done)
    y = _experts_by_row(recv, counts, first_expert, a, b)
    with s.on_comm():
        (y,) = overlap.to_comm(handoff("combine", "C"), y)
        out = backend.combine(y, d.handle)
    (out,) = overlap.from_comm(handoff("combine", "D"), out)
    return out


def microbatch_calls_in_flight(rank, world, device, route, backend, hidden, num_experts, top_k, iters,
                               dtype=torch.bfloat16):
    s = overlap.Streams(device)
    L = num_experts // world
    a, b = expert_params(num_experts, hidden, dtype, device, 23)
    errors = []

    def microbatch(it, tag):
        g = torch.Generator().manual_seed(700 + it * 31 + tag * 7 + rank)
        T = 1 + (it * 89 + tag * 41 + rank * 13) % 512
        x = torch.randn(T, hidden, generator=g).to(dtype).to(device).requires_grad_(True)
        idx, w = route(T, num_experts, top_k, MODES[(it + tag) % len(MODES)], g)
        w = w.clone().requires_grad_(True)
        grad = torch.randn(T, hidden, generator=g).to(dtype).to(device)
        return x, idx, w, grad

    for it in range(iters):
        x_a, idx_a, w_a, g_a = microbatch(it, 0)
        x_b, idx_b, w_b, g_b = microbatch(it, 1)
        out_a = _oracle_layer(s, backend, x_a, idx_a, w_a, rank * L, a, b)  # A's forward, alone
        out_b, crossings = _in_two_threads(
            device,
            lambda: _oracle_layer(s, backend, x_b, idx_b, w_b, rank * L, a, b),  # B's forward ...
            lambda: (out_a.float() * g_a.float()).sum().backward(),  # ... beside A's backward
            num_layers=1,
        )
        if crossings != 6:  # A, B, C in the forward thread; C, B, A in the backward thread
            errors.append(f"iteration {it}: the threads met at {crossings} sync points, not 6")
        xr = x_a.detach().float().cpu().requires_grad_(True)
        wr = w_a.detach().cpu().requires_grad_(True)
        (reference_forward(xr, idx_a.cpu(), wr, a.cpu(), b.cpu()) * g_a.float().cpu()).sum().backward()
        ref_b = reference_forward(x_b.detach().cpu(), idx_b.cpu(), w_b.detach().cpu(), a.cpu(), b.cpu())
        for what, got, want, tol in (("forward of B", out_b, ref_b, 3e-2), ("grad x of A", x_a.grad, xr.grad, 3e-2),
                                     ("grad w of A", w_a.grad, wr.grad, 5e-2)):
            err = (got.detach().float().cpu() - want).abs().max().item() if want.numel() else 0.0
            if err > tol * max(1.0, want.abs().max().item() if want.numel() else 0.0):
                errors.append(f"iteration {it}: {what} differs from the reference by {err}")
    if s.cuda:
        torch.cuda.synchronize()
    if hasattr(backend, "check_errors"):
        backend.check_errors(synchronize=True)
    assert not errors, errors


def microbatch_layer_matches_plain(rank, world, device, make_backend):
    tokens = [torch.randint(0, 2048, (1, 64), generator=torch.Generator().manual_seed(60 + 10 * m + rank)).to(device)
              for m in range(2)]
    failures = []
    for grouped_mm, tol in ((False, 1e-4), (True, 2e-2)):
        for ac, mode in (("none", "none"), ("full:2", "none"), ("none", "chunked"), ("full:2", "chunked")):
            model, backends = _model(rank, world, device, make_backend, ac, grouped_mm)
            for block in model.layers.values():
                if block.moe_enabled:
                    block.moe.sync_points = True
            for backend in backends:
                backend.config.overlap = mode
            calls = _count_calls(backends)
            where = f"grouped_mm={grouped_mm} ac={ac} overlap={mode}"

            def loss_of(m):
                return model(tokens[m]).float().square().mean()

            model.zero_grad(set_to_none=True)
            plain = []
            for m in range(2):  # forward, backward, forward, backward in this thread
                loss = loss_of(m)
                loss.backward()
                plain.append(loss.item())
            want = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

            model.zero_grad(set_to_none=True)
            calls.update(dispatch=0, combine=0)
            loss_a = loss_of(0)
            loss_b, crossings = _in_two_threads(device, lambda: loss_of(1), loss_a.backward, num_layers=2)
            loss_b.backward()
            got = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            if device.type == "cuda":
                torch.cuda.synchronize()
            for backend in backends:
                if hasattr(backend.backend, "check_errors"):
                    backend.backend.check_errors(synchronize=True)
            # two MoE layers: A B C D A B C (D ends it) and (D) C B A D C B A, also where the
            # backward's layers ran chunked (their two chunks meet once per point)
            if crossings != 14:
                failures.append(f"{where}: the threads met at {crossings} sync points, not 14")
            # once per layer and microbatch; "chunked": microbatch 0's forward ran outside the
            # pair, in two chunks, microbatch 1's in it, in one
            per_step = 2 * 2 + 2 if mode == "chunked" else 4
            if calls != {"dispatch": per_step, "combine": per_step}:
                failures.append(f"{where}: calls for two microbatches {calls}, not {per_step} each")
            for m, loss in enumerate((loss_a.item(), loss_b.item())):
                if abs(loss - plain[m]) > tol * max(1.0, abs(plain[m])):
                    failures.append(f"{where}: microbatch {m}'s loss {loss} vs {plain[m]}")
            if want.keys() != got.keys():
                failures.append(f"{where}: gradients for different parameters")
                continue
            for name, g in want.items():
                err = (got[name] - g).abs().max().item()
                if not torch.isfinite(got[name]).all() or err > tol * max(g.abs().max().item(), 1e-6):
                    failures.append(f"{where}: {name} differs by {err} (largest {g.abs().max().item()})")
    assert not failures, "\n".join(failures)
