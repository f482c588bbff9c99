"""Speculative decoding with a TP-sharded torch model, end to end, on ipc_dpsample.

    python examples/spec_decode.py --device cpu --tp 1 --no-spec --requests 4 --max-new-tokens 12 --seed 3
    python examples/spec_decode.py --device cpu --tp 2 --verify swap   --requests 4 --max-new-tokens 12 --seed 3
    python examples/spec_decode.py --device cpu --tp 3 --verify argmax --requests 4 --max-new-tokens 12 --seed 3

All three print the same ``tokens`` (the last line of output is one JSON object).

The loop, per decode step, on every TP rank:

1. the live requests (finished ones have left) fill the first ``bs`` rows of a batch
   padded to a bucket ``pad_bs`` (a multiple of tp); the other rows are phantoms;
2. an early-exit draft (the target's first layer, same head) proposes ``N-1`` tokens
   per request;
3. the target runs on ``N`` positions per request: the trunk replicated on every rank,
   the LM head vocabulary-parallel, so each rank holds logits ``[pad_bs*N, V/tp]``;
4. verify through the package (``--verify swap|argmax|fused``, see spec_verify.py):
   every rank ends with ``predict``, ``accept_index`` and ``accept_length`` of the whole
   batch, with ``bs=`` telling the package the real requests (a host int, or with
   ``--device-bs`` an int32 device scalar);
5. each request gains ``accept_length`` tokens: its accepted drafts and the bonus token.

Greedy speculative decoding must give exactly the tokens of plain greedy decoding
(``--no-spec``, tp=1), and sampled speculative decoding ("sample, then match" with
noise keyed by seed, token index and token id) exactly those of plain sampled
decoding with the same seeds; ``--check`` runs that reference and compares.

Where it runs: ``--device cpu`` (gloo ranks spawned by ``ipc_dpsample.testing.run_ranks``),
``--device cuda`` on one GPU (rank threads sharing it, ``--launch threads``, the default,
or processes, ``--launch processes``), or under ``torchrun`` (one GPU per rank).
``--cuda-graph`` captures the verify step per bucket where the backend allows.
"""  # noqa: E501  (the command lines above, kept whole)

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from spec_model import (  # the example's own modules, next to this file
    KVCache,
    ModelConfig,
    TinyLM,
    config_from_weights,
    load_weights,
    make_weights,
    save_weights,
)
from spec_verify import Clock, Fence, SamplingParams, StepInputs, Verifier

from ipc_dpsample import DpSamplingComm, ThreadGroup
from ipc_dpsample.launch import init_distributed, launched_world
from ipc_dpsample.testing import run_ranks, run_threads

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def out(line: str = "") -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# -- the batch ------------------------------------------------------------------------
def buckets_for(tp: int, requests: int, explicit: list[int] | None) -> list[int]:
    """Padded batch sizes a step may use: ``explicit``, or ``tp * 2**k`` up to the first
    one that holds every request."""
    if explicit:
        return sorted(set(explicit))
    sizes = [tp]
    while sizes[-1] < requests:
        sizes.append(sizes[-1] * 2)
    return sizes


def pick_bucket(buckets: list[int], live: int) -> int:
    """The smallest bucket that holds ``live`` requests."""
    for b in buckets:
        if b >= live:
            return b
    raise ValueError(f"{live} live requests do not fit the largest bucket {buckets[-1]}")


def make_prompts(requests: int, seed: int, vocab_limit: int, lengths: tuple[int, int]):
    """Prompts of different lengths and per-request budgets (some finish early)."""
    g = torch.Generator().manual_seed(1_000_003 * int(seed) + 17)
    lo, hi = lengths
    prompts = []
    for _ in range(requests):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        prompts.append(torch.randint(0, vocab_limit, (n,), generator=g).tolist())
    return prompts


def make_budgets(requests: int, max_new_tokens: int) -> list[int]:
    """Request ``i`` may generate ``max_new - i*max_new // (2*requests)`` tokens: the
    first the whole ``--max-new-tokens``, the last about half, so requests finish at
    different steps and leave the batch."""
    return [max(1, max_new_tokens - i * max_new_tokens // (2 * requests)) for i in range(requests)]


@dataclass
class Request:
    rid: int
    prompt: list[int]
    budget: int
    out: list[int] = field(default_factory=list)
    length: int = 0  # positions whose keys/values are in the cache
    last: int = 0  # the next token to feed (not in the cache yet)

    @property
    def done(self) -> bool:
        return len(self.out) >= self.budget


# -- CUDA graphs of the verify step ---------------------------------------------------
class GraphedVerifier:
    """``--cuda-graph``: the verify step (communication and verify math) as one CUDA
    graph per bucket. A bucket's first step runs eagerly (loads kernels, warms up),
    then the graph is captured; later steps copy their inputs into its static buffers
    and replay it. ``bs`` is the decoder's int32 device scalar, rewritten before each
    replay. With rank threads on one GPU the ranks capture one after another, all
    between barriers (no op in flight, no rank allocating while another captures)."""

    def __init__(self, verifier: Verifier, group: Any, rank: int, tp: int):
        self.v, self.group, self.rank, self.tp = verifier, group, rank, tp
        self.graphs: dict[int, tuple[Any, StepInputs, Any]] = {}

    def run(self, x: StepInputs, pad_bs: int) -> Any:
        entry = self.graphs.get(pad_bs)
        if entry is None:
            outs = self.v.run(x, pad_bs)
            outs = tuple(t.clone() for t in outs)  # read them after the capture
            self._capture(x, pad_bs)
            return outs
        graph, static, outs = entry
        with self.v.clock.section("verify_math"):  # an engine would write them in place
            for name in ("local_logits", "candidates", "temperature", "seed", "offset"):
                getattr(static, name).copy_(getattr(x, name))
        with self.v.clock.section("verify_comm"):
            self.v.fence.before("replay")
            graph.replay()
            self.v.fence.after("replay")
        return outs

    def _capture(self, x: StepInputs, pad_bs: int) -> None:
        if not isinstance(x.bs, torch.Tensor):
            raise ValueError("a captured verify step needs bs as a device scalar")
        static = StepInputs(
            local_logits=x.local_logits.clone(),
            candidates=x.candidates.clone(),
            temperature=x.temperature.clone(),
            seed=x.seed.clone(),
            offset=x.offset.clone(),
            bs=x.bs,
        )
        fence, clock = self.v.fence, self.v.clock
        fence.before("capture")
        threads = fence.group is not None
        turns = range(self.tp) if threads else [self.rank]
        for turn in turns:
            if turn == self.rank:
                fence.enabled = clock.enabled = False
                try:
                    graph = torch.cuda.CUDAGraph()
                    stream = torch.cuda.current_stream()
                    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                        outs = self.v.run(static, pad_bs)
                finally:
                    fence.enabled = clock.enabled = True
            if threads:
                self.group.barrier(timeout_s=fence.timeout_s, what=f"capture turn {turn}")
        self.graphs[pad_bs] = (graph, static, outs)

    def release(self) -> None:
        self.graphs.clear()  # before comm.close() (NCCL keeps captured communicators)


# -- the decode loop ------------------------------------------------------------------
class Decoder:
    """Runs requests to completion on one rank (every rank runs the same loop)."""

    def __init__(
        self,
        model: TinyLM,
        verifier: Verifier | GraphedVerifier,
        *,
        n: int,
        buckets: list[int],
        device: torch.device,
        clock: Clock,
        sampling: SamplingParams | None,
        device_bs: bool,
        seed: int,
        check_index: bool,
    ) -> None:
        self.model, self.verifier, self.n, self.buckets = model, verifier, n, buckets
        self.tp = model.tp
        self.device, self.clock, self.sampling, self.seed = device, clock, sampling, seed
        self.check_index = check_index
        self.bs_dev = torch.zeros(1, dtype=torch.int32, device=device) if device_bs else None

    def generate(self, prompts: list[list[int]], budgets: list[int]) -> dict[str, Any]:
        model, n, dev, clock = self.model, self.n, self.device, self.clock
        cfg = model.cfg
        reqs = [Request(i, p, b) for i, (p, b) in enumerate(zip(prompts, budgets, strict=True))]
        max_len = max(len(p) for p in prompts) + max(budgets) + n + 1
        cache = KVCache(cfg, len(reqs) + 1, max_len, dev)
        t0 = time.perf_counter()
        self._prefill(reqs, cache)
        clock.sync()
        prefill_s = time.perf_counter() - t0
        clock.totals.clear()
        steps = phantom_rows = accepted = proposed = 0
        gained: list[int] = []
        pad_seen: set[int] = set()
        t_loop = time.perf_counter()
        while live := [q for q in reqs if not q.done]:
            steps += 1
            bs = len(live)
            pad_bs = pick_bucket(self.buckets, bs)
            pad_seen.add(pad_bs)
            phantom_rows += pad_bs - bs
            pad = pad_bs - bs
            last = torch.tensor([q.last for q in live] + [0] * pad, device=dev)
            lengths = torch.tensor([q.length for q in live] + [0] * pad, device=dev)
            slots = torch.tensor([q.rid for q in live] + [cache.scratch] * pad, device=dev)
            with clock.section("forward"):
                cand = last[:, None]
                if n > 1:
                    drafts = model.draft_tokens(last, lengths, slots, cache, n - 1)
                    cand = torch.cat((cand, drafts), dim=1)
                pos = lengths[:, None] + torch.arange(n, device=dev)[None, :]
                h = model.trunk(cand, pos, slots, cache)
                local_logits = model.head_logits_shard(h.reshape(pad_bs * n, cfg.hidden))
            x = self._inputs(live, pad_bs, local_logits, cand)
            per_rank = pad_bs // self.tp
            predict, accept_index, accept_length = self.verifier.run(x, pad_bs)
            pred = predict[:bs].tolist()
            alen = accept_length[:bs].tolist()
            aidx = accept_index[:bs].tolist() if self.check_index else None
            for i, q in enumerate(live):
                k = int(alen[i])
                if not 1 <= k <= n:
                    raise RuntimeError(f"step {steps}: request {q.rid} accept_length {k}")
                row0 = (i % per_rank) * n  # TokenSpeed numbers the owner rank's rows
                if aidx is not None and aidx[i] != [row0 + j for j in range(k)] + [-1] * (n - k):
                    raise RuntimeError(
                        f"step {steps}: request {q.rid} (row {i}) accept_index {aidx[i]} "
                        f"!= {row0} .. {row0 + k - 1} then -1"
                    )
                new = [int(t) for t in pred[i][:k]]
                q.length += k
                q.last = new[-1]
                q.out.extend(new[: q.budget - len(q.out)])
                accepted += k - 1
                proposed += n - 1
                gained.append(k)
        clock.sync()
        wall = time.perf_counter() - t_loop
        tokens = [q.out for q in reqs]
        for q in reqs:
            for j, t in enumerate(q.out):
                if not 0 <= t < cfg.vocab_limit:
                    raise RuntimeError(
                        f"request {q.rid} position {j}: token {t} is outside the real "
                        f"vocabulary [0, {cfg.vocab_limit}): the padded tail was not trimmed"
                    )
        generated = sum(len(t) for t in tokens)
        timing = {k: clock.totals.get(k, 0.0) for k in ("forward", "verify_comm", "verify_math")}
        timing["rest"] = max(0.0, wall - sum(timing.values()))
        return {
            "tokens": tokens,
            "steps": steps,
            "generated": generated,
            "accept_rate": accepted / proposed if proposed else None,
            "tokens_per_step": sum(gained) / len(gained) if gained else 0.0,
            "wall_s": wall,
            "prefill_s": prefill_s,
            "tokens_per_s": generated / wall if wall > 0 else 0.0,
            "timing_s": timing,
            "pad_bs": sorted(pad_seen),
            "phantom_rows": phantom_rows,
        }

    def _prefill(self, reqs: list[Request], cache: KVCache) -> None:
        """Keys and values of every prompt but its last token (fed by the first step)."""
        longest = max(len(q.prompt) for q in reqs) - 1
        toks = torch.tensor([q.prompt[:-1] + [0] * (longest - len(q.prompt) + 1) for q in reqs])
        toks = toks.to(self.device)
        pos = torch.arange(longest, device=self.device)[None, :].expand(len(reqs), -1)
        slots = torch.arange(len(reqs), device=self.device)
        if longest > 0:
            self.model.trunk(toks, pos, slots, cache)
        for q in reqs:
            q.length, q.last = len(q.prompt) - 1, q.prompt[-1]

    def _inputs(
        self, live: list[Request], pad_bs: int, local_logits: torch.Tensor, cand: torch.Tensor
    ) -> StepInputs:
        pad, dev = pad_bs - len(live), self.device
        temp = self.sampling.temperature if self.sampling is not None else 0.0
        bs: int | torch.Tensor = len(live)
        if self.bs_dev is not None:
            self.bs_dev.fill_(len(live))
            bs = self.bs_dev
        return StepInputs(
            local_logits=local_logits,
            candidates=cand.to(torch.int32),
            temperature=torch.tensor([temp] * len(live) + [0.0] * pad, device=dev),
            seed=torch.tensor([self.seed + q.rid for q in live] + [0] * pad, device=dev),
            offset=torch.tensor([len(q.out) for q in live] + [0] * pad, device=dev),
            bs=bs,
        )


# -- one rank ---------------------------------------------------------------------------
def model_config(args: argparse.Namespace) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model of ``--weights`` or of ``--model-seed`` (default ``--seed``)."""
    if args.weights:
        weights = load_weights(args.weights)
        cfg = config_from_weights(
            weights, heads=args.heads, vocab_limit=args.vocab_limit, draft_layers=args.draft_layers
        )
        return cfg, weights
    cfg = ModelConfig(
        vocab_size=args.vocab_size,
        vocab_limit=args.vocab_limit if args.vocab_limit is not None else 32000,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        mlp=args.mlp,
        draft_layers=args.draft_layers,
    )
    seed = args.seed if args.model_seed is None else args.model_seed
    return cfg, make_weights(cfg, seed)


def sampling_of(args: argparse.Namespace) -> SamplingParams | None:
    if not args.temperature:
        return None
    return SamplingParams(args.temperature, args.top_k, args.top_p)


def rank_main(rank: int, tp: int, group: Any, opts: dict[str, Any]) -> dict[str, Any]:
    """One TP rank: build the model shard and the communicator, decode, report.

    ``group``: None (the torch.distributed world: spawned gloo ranks or torchrun) or a
    :class:`ipc_dpsample.ThreadGroup` (rank threads sharing a GPU)."""
    args = argparse.Namespace(**opts)
    if args.device == "cuda":
        if isinstance(group, ThreadGroup):
            index = 0  # rank threads share the GPU
        else:
            index = torch.cuda.current_device()  # init_distributed set LOCAL_RANK's
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        with torch.cuda.stream(torch.cuda.Stream(device)):  # one stream per rank
            return _rank(rank, tp, group, args, device)
    if os.environ.get("IPC_DPSAMPLE_SPAWNED") == "1":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    return _rank(rank, tp, group, args, torch.device("cpu"))


def _rank(
    rank: int, tp: int, group: Any, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    cfg, weights = model_config(args)
    n = 1 if args.no_spec else args.draft_tokens + 1
    prompts = make_prompts(args.requests, args.seed, cfg.vocab_limit, tuple(args.prompt_len))
    budgets = make_budgets(args.requests, args.max_new_tokens)
    max_pos = max(len(p) for p in prompts) + max(budgets) + n + 1
    model = TinyLM(
        cfg,
        weights,
        tp=tp,
        rank=rank,
        device=device,
        logits_dtype=DTYPES[args.logits_dtype],
        max_positions=max_pos,
    )
    buckets = (
        list(range(1, args.requests + 1))  # the reference: no phantom rows
        if args.no_spec
        else buckets_for(tp, args.requests, args.buckets)
    )
    clock = Clock(device)
    fence = Fence(group, device, args.timeout)
    sampling = sampling_of(args)
    notes: list[str] = []
    comm = None
    if not args.no_spec:
        comm = DpSamplingComm(
            tp_size=tp,
            rank=rank,
            group=group,
            max_pad_bs=buckets[-1],
            num_tokens_per_req=n,
            vocab_size=cfg.vocab_size,
            logits_dtype=args.logits_dtype,
            device=device,
            timeout_s=args.timeout,
        )
    verifier: Verifier | GraphedVerifier | None = None
    try:
        route = "local" if comm is None else args.verify
        verifier = Verifier(
            route,
            comm,
            tp=tp,
            rank=rank,
            n=n,
            vocab_size=cfg.vocab_size,
            vocab_limit=cfg.vocab_limit,
            sampling=sampling,
            clock=clock,
            fence=fence,
            sampler=args.sampler,
        )
        graphed = False
        if args.cuda_graph and comm is not None:
            # explain() starts with the path that moves the data; torch.distributed's
            # (gloo, or its NCCL group) cannot be captured
            if sampling is not None and args.sampler == "package":
                notes.append(
                    "--cuda-graph: the package's sampler runs on the host and cannot be "
                    "captured; the verify step runs eagerly"
                )
            elif comm.explain().split(":", 1)[0] in ("onesided", "nccl"):
                verifier = GraphedVerifier(verifier, group, rank, tp)
                graphed = True
            else:
                notes.append(
                    f"--cuda-graph: this path cannot be captured ({comm.explain()}); "
                    "the verify step runs eagerly"
                )
        decoder = Decoder(
            model,
            verifier,
            n=n,
            buckets=buckets,
            device=device,
            clock=clock,
            sampling=sampling,
            device_bs=args.device_bs or graphed,
            seed=args.seed,
            check_index=True,
        )
        runs = [decoder.generate(prompts, budgets) for _ in range(args.repeat)]
    finally:
        if isinstance(verifier, GraphedVerifier):
            verifier.release()  # graphs first: NCCL keeps communicators they captured
        if comm is not None:
            comm.close()
    return {
        "rank": rank,
        "runs": runs,
        "backend": comm.backend if comm is not None else "none",
        "explain": comm.explain() if comm is not None else "no communicator (tp=1 reference)",
        "notes": notes,
        "graphed": graphed,
        "n": n,
        "vocab": [cfg.vocab_size, cfg.vocab_limit],
        "budgets": budgets,
        "prompt_lens": [len(p) for p in prompts],
    }


# -- launching ----------------------------------------------------------------------------
def launch(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run every rank; returns the per-rank reports this process can see (all of them
    when it spawned the ranks; its own under torchrun, empty on ranks other than 0)."""
    opts = vars(args).copy()
    world = launched_world()
    launched = world is not None and os.environ.get("IPC_DPSAMPLE_SPAWNED") != "1"
    if args.no_spec:  # the reference: no communicator, no ranks (rank 0 reports)
        report = rank_main(0, 1, None, opts)
        return [report] if not launched or world[0] == 0 else []
    if launched:
        rank, size = init_distributed("gloo" if args.device == "cpu" else None)
        if args.tp != size:
            raise SystemExit(f"error: --tp {args.tp} but the launcher started {size} ranks")
        opts["tp"] = size
        report = rank_main(rank, size, None, opts)
        return [report] if rank == 0 else []
    tp = args.tp
    if args.device == "cuda":
        if args.launch == "processes":
            return run_ranks(tp, rank_main, opts, timeout_s=args.timeout * 4 + 300)
        return run_threads(tp, rank_main, opts, timeout_s=args.timeout * 4 + 300)
    if tp == 1:  # a world of one in this process
        import torch.distributed as dist

        init_distributed("gloo")
        try:
            return [rank_main(0, 1, None, opts)]
        finally:
            dist.destroy_process_group()
    return run_ranks(tp, rank_main, opts, timeout_s=args.timeout * 4 + 120)


def first_difference(got: list[list[int]], want: list[list[int]]) -> str | None:
    """None when equal, else where the first token differs (request, position)."""
    if len(got) != len(want):
        return f"{len(got)} requests != {len(want)}"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        for j, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return f"request {i} position {j}: {x} != {y}"
        if len(a) != len(b):
            return f"request {i}: {len(a)} tokens != {len(b)}"
    return None


def summarize(args: argparse.Namespace, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Print the table (one row per run), the notes and the check; return the JSON."""
    rep = reports[0]
    for other in reports[1:]:
        for run, run0 in zip(other["runs"], rep["runs"], strict=True):
            diff = first_difference(run["tokens"], run0["tokens"])
            if diff:
                raise RuntimeError(f"rank {other['rank']} disagrees with rank 0: {diff}")
    runs = rep["runs"]
    for k, run in enumerate(runs[1:], start=2):
        diff = first_difference(run["tokens"], runs[0]["tokens"])
        if diff:
            raise RuntimeError(f"run {k} differs from run 1: {diff}")
    sampling = sampling_of(args)
    mode = "plain (--no-spec)" if args.no_spec else f"verify={args.verify}"
    how = "greedy"
    if sampling is not None:
        how = f"sampled (temperature {sampling.temperature}, top_k {sampling.top_k}, "
        how += f"top_p {sampling.top_p}, {args.sampler} sampler)"
    tp = args.tp
    out(
        f"spec_decode: {mode} tp={tp} device={args.device} backend={rep['backend']} "
        f"logits={args.logits_dtype} N={rep['n']} requests={args.requests} {how} "
        f"bs={'device' if args.device_bs or rep['graphed'] else 'host'}"
        f"{' cuda-graph' if rep['graphed'] else ''}"
    )
    out(f"  {rep['explain']}")
    out(
        f"  V={rep['vocab'][0]} (real {rep['vocab'][1]}), prompts {rep['prompt_lens']}, "
        f"budgets {rep['budgets']}, pad_bs buckets used {runs[-1]['pad_bs']}, "
        f"phantom rows {runs[-1]['phantom_rows']}"
    )
    head = (
        f"  {'run':>3} {'steps':>5} {'tokens':>6} {'tok/req-step':>12} {'accept':>6} "
        f"{'tok/s':>9} | ms/step: {'forward':>8} {'comm':>8} {'verify':>8} {'rest':>8} "
        f"| {'verify share':>12}"
    )
    out(head)
    for k, run in enumerate(runs, start=1):
        t = run["timing_s"]
        per = {key: 1e3 * v / max(1, run["steps"]) for key, v in t.items()}
        share = (t["verify_comm"] + t["verify_math"]) / max(1e-12, sum(t.values()))
        acc = "-" if run["accept_rate"] is None else f"{run['accept_rate']:.3f}"
        out(
            f"  {k:>3} {run['steps']:>5} {run['generated']:>6} {run['tokens_per_step']:>12.2f} "
            f"{acc:>6} {run['tokens_per_s']:>9.1f} |          {per['forward']:>8.2f} "
            f"{per['verify_comm']:>8.2f} {per['verify_math']:>8.2f} {per['rest']:>8.2f} "
            f"| {100 * share:>11.1f}%"
        )
    out(
        "  (comm: the package's ops, host fences included; verify: the rank's verify math"
        f"{'; with --cuda-graph, comm is the whole replayed step' if rep['graphed'] else ''})"
    )
    for note in rep["notes"]:
        out(f"  note: {note}")
    last = runs[-1]
    if args.check:
        ref_opts = vars(args).copy()
        ref_opts.update(no_spec=True, tp=1, cuda_graph=False, repeat=1, device_bs=False)
        ref = rank_main(0, 1, None, ref_opts)["runs"][0]
        diff = first_difference(last["tokens"], ref["tokens"])
        if diff:
            raise RuntimeError(f"check failed: tokens differ from --no-spec (tp=1): {diff}")
        out(
            f"  check: tokens identical to plain {how} decoding (--no-spec, tp=1): "
            f"{args.requests} requests, {last['generated']} tokens"
        )
    t = last["timing_s"]
    return {
        "tokens": last["tokens"],
        "accept_rate": last["accept_rate"],
        "tokens_per_s": round(last["tokens_per_s"], 3),
        "tokens_per_step": round(last["tokens_per_step"], 4),
        "steps": last["steps"],
        "mode": "no-spec" if args.no_spec else args.verify,
        "tp": tp,
        "device": args.device,
        "backend": rep["backend"],
        "logits_dtype": args.logits_dtype,
        "sampling": None if sampling is None else vars(sampling) | {"sampler": args.sampler},
        "seed": args.seed,
        "bs": "device" if args.device_bs or rep["graphed"] else "host",
        "cuda_graph": rep["graphed"],
        "pad_bs": last["pad_bs"],
        "phantom_rows": last["phantom_rows"],
        "timing_ms_per_step": {k: round(1e3 * v / last["steps"], 4) for k, v in t.items()},
        "verify_share": round((t["verify_comm"] + t["verify_math"]) / sum(t.values()), 4),
        "repeat": len(runs),
    }


# -- command line -------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    a = p.add_argument
    a("--device", choices=("cpu", "cuda"), default="cpu")
    a("--tp", type=int, default=None, help="TP ranks (default 1, or the launcher's world)")
    a("--no-spec", action="store_true", help="plain one-token-per-step decoding, tp=1")
    a("--verify", choices=("swap", "argmax", "fused"), default="swap")
    a("--requests", type=int, default=4)
    a("--max-new-tokens", type=int, default=12)
    a("--draft-tokens", type=int, default=3, help="drafts per request and step (N-1)")
    a("--seed", type=int, default=0, help="prompts, sampling noise, and the model")
    a("--model-seed", type=int, default=None, help="the model's weights (default --seed)")
    a("--weights", default=None, help="state dict to load (torch.save or .safetensors)")
    a("--save-weights", default=None, help="write the seeded model's state dict and exit")
    a("--temperature", type=float, default=0.0, help="0: greedy")
    a("--top-k", type=int, default=None)
    a("--top-p", type=float, default=None)
    a(
        "--sampler",
        choices=("auto", "torch", "package"),
        default="auto",
        help="sampled verify: the example's torch sampler, or the package's reference\n"
        "(ipc_dpsample.layout, NumPy on the host: the tokens verify_batch_vocab gives);\n"
        "auto: package for --verify fused (its --check reference), else torch",
    )
    a("--logits-dtype", choices=tuple(DTYPES), default="float32")
    a("--buckets", default=None, help="padded batch sizes, e.g. 4,8 (multiples of tp)")
    a("--device-bs", action="store_true", help="pass bs as an int32 device scalar")
    a("--cuda-graph", action="store_true", help="capture the verify step (GPU)")
    a("--launch", choices=("threads", "processes"), default="threads", help="one GPU")
    a("--repeat", type=int, default=1, help="decode the batch this many times")
    a("--check", action="store_true", help="compare with --no-spec at tp=1")
    a("--timeout", type=float, default=60.0, help="the communicator's timeout_s")
    a("--prompt-len", type=int, nargs=2, default=(4, 12), metavar=("MIN", "MAX"))
    a("--vocab-size", type=int, default=32760)
    a("--vocab-limit", type=int, default=None, help="real vocabulary (default 32000)")
    a("--hidden", type=int, default=64)
    a("--layers", type=int, default=2)
    a("--heads", type=int, default=4)
    a("--mlp", type=int, default=128)
    a("--draft-layers", type=int, default=1)
    args = p.parse_args(argv)
    if args.buckets is not None:
        try:
            args.buckets = [int(b) for b in args.buckets.split(",") if b]
        except ValueError:
            p.error(f"--buckets {args.buckets!r}: expected integers like 4,8")
    if args.tp is None:  # under torchrun / mpirun: the launched world
        world = launched_world()
        args.tp = 1 if world is None or args.no_spec else world[1]
    tp = args.tp
    if tp < 1:
        p.error(f"--tp {tp}: expected >= 1")
    if args.no_spec and tp != 1:
        p.error("--no-spec is the tp=1 reference: use --tp 1")
    has_fused = hasattr(DpSamplingComm, "verify_batch_vocab")
    if args.verify == "fused" and not args.no_spec and not has_fused:
        import ipc_dpsample

        p.error(
            "--verify fused needs DpSamplingComm.verify_batch_vocab, which this version of "
            f"ipc_dpsample ({ipc_dpsample.__version__}) does not have: not available yet; "
            "use --verify swap or --verify argmax"
        )
    if args.temperature < 0:
        p.error(f"--temperature {args.temperature}: expected >= 0")
    if args.verify == "argmax" and args.temperature > 0 and not args.no_spec:
        p.error(
            "--verify argmax is greedy only (argmax_batch_vocab returns the arg-max id): "
            "drop --temperature, or use --verify swap for sampled verify"
        )
    if (args.top_k is not None or args.top_p is not None) and not args.temperature > 0:
        p.error("--top-k / --top-p select sampled verify: give --temperature > 0 too")
    if args.top_k is not None and args.top_k < 1:
        p.error(f"--top-k {args.top_k}: expected >= 1")
    if args.sampler == "auto":
        args.sampler = "package" if args.verify == "fused" else "torch"
    if args.verify == "fused" and args.temperature > 0 and args.sampler == "torch":
        p.error(
            "--verify fused samples as the package's reference does: --sampler torch "
            "samples other tokens (use --sampler package, the default for fused)"
        )
    if args.sampler == "package" and args.top_k is not None and args.top_k > 128:
        p.error(f"--top-k {args.top_k}: the package's sampler takes top-k up to 128")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        p.error(f"--top-p {args.top_p}: expected 0 < top_p <= 1")
    if args.requests < 1 or args.max_new_tokens < 1 or args.draft_tokens < 1 or args.repeat < 1:
        p.error("--requests, --max-new-tokens, --draft-tokens and --repeat must be >= 1")
    if args.prompt_len[0] < 2 or args.prompt_len[1] < args.prompt_len[0]:
        p.error(f"--prompt-len {args.prompt_len}: expected 2 <= MIN <= MAX")
    if args.buckets and not args.no_spec:
        bad = [b for b in args.buckets if b < 1 or b % tp]
        if bad:
            p.error(f"--buckets {args.buckets}: {bad} not positive multiples of tp={tp}")
        if max(args.buckets) < args.requests:
            p.error(f"--buckets {args.buckets}: the largest must hold {args.requests} requests")
    if args.vocab_size % tp:
        p.error(f"--vocab-size {args.vocab_size} is not a multiple of tp={tp}")
    if args.cuda_graph and args.device != "cuda":
        p.error("--cuda-graph needs --device cuda (the CPU path cannot be captured)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Run the example; returns the JSON object it printed last (None on ranks > 0)."""
    args = parse_args(argv)
    try:  # a bad --weights file or model shape fails here, before any rank starts
        cfg, weights = model_config(args)
        if args.weights:
            TinyLM(cfg, weights, tp=1, rank=0, device=torch.device("cpu"))
    except (OSError, ValueError, ImportError, RuntimeError) as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.save_weights:
        save_weights(weights, args.save_weights)
        out(f"wrote {args.save_weights}: {len(weights)} tensors, {cfg}")
        return None
    del weights
    if args.device == "cuda":
        if args.launch == "threads":  # several spinning ranks per GPU: a queue each
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # before CUDA starts
        if not torch.cuda.is_available():
            raise SystemExit("error: --device cuda: no CUDA GPU is visible to torch")
    reports = launch(args)
    if not reports:
        return None
    result = summarize(args, reports)
    out(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
