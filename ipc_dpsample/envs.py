"""Every environment variable the library reads, in one registry, read lazily.

Nothing is read at import time: :func:`get` parses a variable when a constructor
asks for it, so a process can set variables after ``import ipc_dpsample`` and a bad
value raises ``ValueError`` naming the variable and what it accepts, at the
constructor, on the rank that has it (the agreement exchange then raises on every
rank). README's environment table is checked against :data:`REGISTRY` by a test.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["REGISTRY", "EnvVar", "OnesidedTuning", "get", "onesided_tuning"]


@dataclass(frozen=True)
class EnvVar:
    """One variable: how to parse it, its default and what it does."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in allowed:
            raise ValueError(f"{value!r}; expected one of {allowed}")
        return value

    return parse


def _int_in(lo: int, hi: int, multiple: int = 1) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(f"{raw!r} is not an integer") from None
        if not lo <= value <= hi or value % multiple:
            extra = f" and a multiple of {multiple}" if multiple > 1 else ""
            raise ValueError(f"{value}; expected an integer in [{lo}, {hi}]{extra}")
        return value

    return parse


def _one_of_ints(*allowed: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = _int_in(min(allowed), max(allowed))(raw)
        if value not in allowed:
            raise ValueError(f"{value}; expected one of {allowed}")
        return value

    return parse


def _flag(raw: str) -> bool:
    return raw.strip().lower() not in ("", "0", "false", "no", "off")


def _verify_block(raw: str) -> int:
    value = raw.strip().lower()
    if value == "auto":
        return 0
    if value not in ("128", "256"):
        raise ValueError(f"{value!r}; expected 'auto', '128' or '256'")
    return int(value)


def _verify_splits(raw: str) -> int:
    if raw.strip().lower() == "auto":
        return 0
    try:
        return _int_in(1, 64)(raw)
    except ValueError:
        raise ValueError(f"{raw.strip()!r}; expected 'auto' or an integer from 1 to 64") from None


def _text(raw: str) -> str:
    return raw.strip()


_BACKENDS = ("auto", "onesided", "nccl", "torch")

REGISTRY: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "IPC_DPSAMPLE_BACKEND",
            _choice(*_BACKENDS),
            None,
            "`auto` / `onesided` / `nccl` / `torch`: overrides the `backend=` argument",
        ),
        EnvVar(
            "TOKENSPEED_DP_SAMPLING_BACKEND",
            _choice(*_BACKENDS),
            None,
            "TokenSpeed compatibility: an alias of `IPC_DPSAMPLE_BACKEND` (which wins when "
            "both are set)",
        ),
        EnvVar(
            "NCCL_P2P_DISABLE",
            _flag,
            False,
            "when true on any rank, `auto` does not pick the one-sided backend",
        ),
        EnvVar(
            "IPC_DPSAMPLE_GRAPH_SWAP",
            _choice("barrier", "copy"),
            "barrier",
            "how swaps run once ops are captured in CUDA graphs: `barrier` (entry barrier, "
            "push into one fixed output) or `copy` (eager push, then a copy into the fixed "
            "output); every rank must use the same (checked at construction)",
        ),
        EnvVar(
            "IPC_DPSAMPLE_SWAP_BLOCK",
            _int_in(32, 1024, 32),
            512,
            "tuning: most threads per swap CTA",
        ),
        EnvVar(
            "IPC_DPSAMPLE_SWAP_CHUNK",
            _int_in(16, 1 << 30, 16),
            32768,
            "tuning: bytes of a row one swap tile moves",
        ),
        EnvVar(
            "IPC_DPSAMPLE_SWAP_CTAS_PER_SM",
            _int_in(1, 32),
            2,
            "tuning: swap CTAs per SM (the grid's cap)",
        ),
        EnvVar(
            "IPC_DPSAMPLE_SWAP_UNROLL",
            _one_of_ints(1, 2, 4, 8, 16),
            4,
            "tuning (compile time): 16-byte loads each swap thread issues before its stores",
        ),
        EnvVar(
            "IPC_DPSAMPLE_SWAP_FIT",
            _flag,
            True,
            "tuning: size swap CTAs to one round of loads per chunk (`0`: always "
            "`IPC_DPSAMPLE_SWAP_BLOCK` threads)",
        ),
        EnvVar(
            "IPC_DPSAMPLE_SWAP_STREAMING",
            _flag,
            False,
            "tuning (compile time): streaming cache hints on the swap's 16-byte moves",
        ),
        EnvVar(
            "IPC_DPSAMPLE_SWAP_CTA_FENCE",
            _choice("gpu", "sys"),
            "gpu",
            "compile time: how a swap CTA publishes its tiles: `gpu` (a GPU-scope acq_rel "
            "counter bump; the last CTA alone fences at system scope before the flags) or "
            "`sys` (a system-scope fence in every CTA, the ordering of 0.1)",
        ),
        EnvVar(
            "IPC_DPSAMPLE_ARGMAX_UNROLL",
            _one_of_ints(1, 2, 4, 8),
            2,
            "tuning (compile time): 16-byte loads each argmax thread issues before it reduces them",
        ),
        EnvVar(
            "IPC_DPSAMPLE_VERIFY_BLOCK",
            _verify_block,
            0,
            "tuning: threads per CTA of the one-sided `verify_batch_vocab` record kernel (one "
            "CTA reduces one row at a time): `auto` (256 when the rows of the ranks on a GPU "
            "fit in one wave of such CTAs, else 128), `128` or `256`",
        ),
        EnvVar(
            "IPC_DPSAMPLE_VERIFY_SPLITS",
            _verify_splits,
            0,
            "tuning: column blocks per row of the one-sided `verify_batch_vocab` record "
            "kernel (one CTA and one record each): `auto` (a small batch's rows split until "
            "the GPU has about 256 blocks of at least 2048 columns) or 1 to 64 (capped by "
            "the records the owners hold); every rank must set the same (the call digest "
            "carries it)",
        ),
        EnvVar(
            "IPC_DPSAMPLE_VERIFY_BROADCAST",
            _choice("auto", "on", "off"),
            "auto",
            "tuning: whether the one-sided `verify_batch_vocab` sends every row's record to "
            "every rank, each rank combining every request (one round, no gather), or to the "
            "row's owner, the results then gathered: `auto` (broadcast up to 64 rows "
            "pad_bs * N), `on` (whenever the records fit the arena), `off`; every rank must "
            "set the same (ranks that differ raise)",
        ),
        EnvVar(
            "IPC_DPSAMPLE_VERIFY_CTAS_PER_SM",
            _one_of_ints(2, 3, 4),
            3,
            "tuning (compile time): 256-thread CTAs of the record kernel the compiler fits on "
            "an SM (their register budget: 128, 80 or 64 per thread)",
        ),
        EnvVar(
            "IPC_DPSAMPLE_VERIFY_UNROLL",
            _one_of_ints(1, 2, 4),
            2,
            "tuning (compile time): 16-byte loads in flight per thread in the record kernel's "
            "first pass over a row (the kernel of batches without top-k rows)",
        ),
        EnvVar(
            "IPC_DPSAMPLE_VERIFY_LIST_UNROLL",
            _one_of_ints(1, 2, 4),
            4,
            "tuning (compile time): the same in the record kernel of batches with top-k rows",
        ),
        EnvVar(
            "IPC_DPSAMPLE_VERIFY_PREFETCH_LINES",
            _one_of_ints(0, 1, 2, 4),
            2,
            "tuning (compile time): 128-byte lines per thread of a record CTA's next row "
            "asked of L2 while the CTA finishes its current row, in the record kernel of "
            "batches without top-k rows (0: off)",
        ),
        EnvVar(
            "IPC_DPSAMPLE_VERIFY_TEMP_ONEPASS",
            _one_of_ints(0, 1, 2),
            1,
            "tuning (compile time): which temperature rows the record kernel of batches "
            "without top-k rows reads once, their maximum and their sampled column from the "
            "same read (the bound on the columns worth scoring rises as the block scores "
            "them), instead of twice: 1 float32 rows (the default), 2 every dtype, 0 none",
        ),
        EnvVar(
            "IPC_DPSAMPLE_LINEINFO",
            _flag,
            False,
            "profiling (compile time): build every kernel with `-lineinfo` (line numbers for "
            "ncu's source counters and compute-sanitizer's reports)",
        ),
        EnvVar(
            "CUDA_DEVICE_MAX_CONNECTIONS",
            _int_in(1, 32),
            8,
            "CUDA's: set to 32 for several ranks on one GPU (`run_threads` does it)",
        ),
        EnvVar(
            "IPC_DPSAMPLE_HOST_ID",
            _text,
            "",
            "test hook: overrides the host id, to simulate a multi-host group on one machine",
        ),
        EnvVar(
            "IPC_DPSAMPLE_TEST_FAIL_IPC",
            _text,
            "",
            "test hook: `open:R` / `verify:R` makes rank R's IPC open / probe read-back fail",
        ),
        EnvVar(
            "IPC_DPSAMPLE_TEST_SINGLE_BUFFER",
            _flag,
            False,
            "test hook: `1` forces one data region (the race the ping-pong design removes)",
        ),
    )
}


def get(name: str) -> Any:
    """The parsed value of registered variable ``name`` (its default when unset or
    empty).

    Raises
    ------
    ValueError
        The value does not parse; the message names the variable and what it accepts.
    KeyError
        ``name`` is not registered (a programming error).
    """
    var = REGISTRY[name]
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return var.default
    try:
        return var.parse(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r}: {exc}") from None


@dataclass(frozen=True)
class OnesidedTuning:
    """The one-sided kernels' knobs (the swap's, the argmax's unroll), read once per
    backend (see BENCHMARKS.md for the measurements behind the defaults)."""

    block: int
    chunk: int
    ctas_per_sm: int
    unroll: int
    fit: bool
    streaming: bool
    graph_swap: str
    argmax_unroll: int = 2
    cta_fence: str = "gpu"
    verify_block: int = 0  # 0: auto (verify_plan.verify_block)
    verify_splits: int = 0  # 0: auto (verify_plan.verify_splits)
    verify_broadcast: str = "auto"  # verify_plan.verify_broadcast's mode
    verify_ctas_per_sm: int = 3
    verify_unroll: int = 2
    verify_list_unroll: int = 4
    verify_prefetch_lines: int = 2
    verify_temp_onepass: int = 1

    @property
    def compile_options(self) -> tuple[str, ...]:
        """nvrtc options of the compile-time knobs."""
        return (
            f"-DDP_SWAP_UNROLL={self.unroll}",
            f"-DDP_SWAP_STREAMING={int(self.streaming)}",
            f"-DDP_ARGMAX_UNROLL={self.argmax_unroll}",
            f"-DDP_SWAP_CTA_RELEASE_GPU={int(self.cta_fence == 'gpu')}",
            f"-DDV_LIST_MIN_CTAS={self.verify_ctas_per_sm}",
            f"-DDV_NOLIST_MIN_CTAS={self.verify_ctas_per_sm}",
            f"-DDV_MAX_UNROLL={self.verify_unroll}",
            f"-DDV_LIST_UNROLL={self.verify_list_unroll}",
            f"-DDV_PREFETCH_LINES={self.verify_prefetch_lines}",
            f"-DDV_TEMP_ONEPASS={self.verify_temp_onepass}",
        )


def onesided_tuning() -> OnesidedTuning:
    """The current environment's :class:`OnesidedTuning` (raises ``ValueError`` on a bad
    value)."""
    return OnesidedTuning(
        block=get("IPC_DPSAMPLE_SWAP_BLOCK"),
        chunk=get("IPC_DPSAMPLE_SWAP_CHUNK"),
        ctas_per_sm=get("IPC_DPSAMPLE_SWAP_CTAS_PER_SM"),
        unroll=get("IPC_DPSAMPLE_SWAP_UNROLL"),
        fit=get("IPC_DPSAMPLE_SWAP_FIT"),
        streaming=get("IPC_DPSAMPLE_SWAP_STREAMING"),
        graph_swap=get("IPC_DPSAMPLE_GRAPH_SWAP"),
        argmax_unroll=get("IPC_DPSAMPLE_ARGMAX_UNROLL"),
        cta_fence=get("IPC_DPSAMPLE_SWAP_CTA_FENCE"),
        verify_block=get("IPC_DPSAMPLE_VERIFY_BLOCK"),
        verify_splits=get("IPC_DPSAMPLE_VERIFY_SPLITS"),
        verify_broadcast=get("IPC_DPSAMPLE_VERIFY_BROADCAST"),
        verify_ctas_per_sm=get("IPC_DPSAMPLE_VERIFY_CTAS_PER_SM"),
        verify_unroll=get("IPC_DPSAMPLE_VERIFY_UNROLL"),
        verify_list_unroll=get("IPC_DPSAMPLE_VERIFY_LIST_UNROLL"),
        verify_prefetch_lines=get("IPC_DPSAMPLE_VERIFY_PREFETCH_LINES"),
        verify_temp_onepass=get("IPC_DPSAMPLE_VERIFY_TEMP_ONEPASS"),
    )
