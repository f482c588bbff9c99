"""The environment registry: lazy parsing, clear errors, README's table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ipc_dpsample import envs

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_environment_table_lists_exactly_the_registry() -> None:
    text = README.read_text()
    section = text[text.index("## Environment variables") :]
    section = section[: section.index("\n## ", 1)]
    names = set(re.findall(r"^\| `([A-Z0-9_]+)` \|", section, flags=re.M))
    assert names == set(envs.REGISTRY), (
        f"README only: {sorted(names - set(envs.REGISTRY))}; "
        f"registry only: {sorted(set(envs.REGISTRY) - names)}"
    )


def test_every_variable_has_a_doc_and_a_default_that_parses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, var in envs.REGISTRY.items():
        assert var.doc, name
        monkeypatch.delenv(name, raising=False)
        assert envs.get(name) == var.default
        monkeypatch.setenv(name, "   ")  # blank counts as unset
        assert envs.get(name) == var.default


@pytest.mark.parametrize(
    ("name", "raw", "pattern"),
    [
        ("IPC_DPSAMPLE_BACKEND", "mpi", r"IPC_DPSAMPLE_BACKEND='mpi'.*expected one of"),
        ("IPC_DPSAMPLE_SWAP_BLOCK", "100", r"SWAP_BLOCK='100'.*\[32, 1024\].*multiple of 32"),
        ("IPC_DPSAMPLE_SWAP_CHUNK", "x", r"SWAP_CHUNK='x'.*not an integer"),
        ("IPC_DPSAMPLE_SWAP_UNROLL", "3", r"SWAP_UNROLL='3'.*one of \(1, 2, 4, 8, 16\)"),
        ("IPC_DPSAMPLE_SWAP_CTAS_PER_SM", "0", r"CTAS_PER_SM='0'.*\[1, 32\]"),
        ("IPC_DPSAMPLE_GRAPH_SWAP", "both", r"GRAPH_SWAP='both'.*'barrier', 'copy'"),
        ("IPC_DPSAMPLE_SWAP_CTA_FENCE", "cta", r"CTA_FENCE='cta'.*'gpu', 'sys'"),
    ],
)
def test_bad_values_name_the_variable_and_what_it_accepts(
    monkeypatch: pytest.MonkeyPatch, name: str, raw: str, pattern: str
) -> None:
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=pattern):
        envs.get(name)


def test_onesided_tuning_reads_the_environment_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IPC_DPSAMPLE_SWAP_UNROLL", "8")
    monkeypatch.setenv("IPC_DPSAMPLE_SWAP_STREAMING", "1")
    monkeypatch.setenv("IPC_DPSAMPLE_GRAPH_SWAP", "COPY")
    monkeypatch.setenv("IPC_DPSAMPLE_ARGMAX_UNROLL", "8")
    monkeypatch.setenv("IPC_DPSAMPLE_SWAP_CTA_FENCE", "SYS")
    monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_CTAS_PER_SM", "4")
    monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_UNROLL", "1")
    monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_LIST_UNROLL", "2")
    monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_PREFETCH_LINES", "1")
    monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_TEMP_ONEPASS", "2")
    monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_BLOCK", "256")
    tun = envs.onesided_tuning()
    assert (tun.unroll, tun.streaming, tun.graph_swap) == (8, True, "copy")
    assert tun.verify_block == 256
    assert tun.compile_options == (
        "-DDP_SWAP_UNROLL=8",
        "-DDP_SWAP_STREAMING=1",
        "-DDP_ARGMAX_UNROLL=8",
        "-DDP_SWAP_CTA_RELEASE_GPU=0",
        "-DDV_LIST_MIN_CTAS=4",
        "-DDV_NOLIST_MIN_CTAS=4",
        "-DDV_MAX_UNROLL=1",
        "-DDV_LIST_UNROLL=2",
        "-DDV_PREFETCH_LINES=1",
        "-DDV_TEMP_ONEPASS=2",
    )
    # each knob unset gives its default; 3, which neither accepts, raises naming it
    for var, default in [
        ("IPC_DPSAMPLE_VERIFY_TEMP_ONEPASS", "-DDV_TEMP_ONEPASS=1"),
        ("IPC_DPSAMPLE_VERIFY_PREFETCH_LINES", "-DDV_PREFETCH_LINES=2"),
    ]:
        monkeypatch.delenv(var)
        assert default in envs.onesided_tuning().compile_options
        monkeypatch.setenv(var, "3")
        with pytest.raises(ValueError, match=rf"{var}='3'"):
            envs.onesided_tuning()
        monkeypatch.delenv(var)
    monkeypatch.delenv("IPC_DPSAMPLE_VERIFY_LIST_UNROLL")
    assert "-DDV_LIST_UNROLL=4" in envs.onesided_tuning().compile_options  # the default
    monkeypatch.delenv("IPC_DPSAMPLE_SWAP_CTA_FENCE")
    assert "-DDP_SWAP_CTA_RELEASE_GPU=1" in envs.onesided_tuning().compile_options
    monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_BLOCK", "192")
    with pytest.raises(ValueError, match=r"IPC_DPSAMPLE_VERIFY_BLOCK='192'.*'auto', '128'"):
        envs.onesided_tuning()
    monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_BLOCK", "Auto")
    assert envs.onesided_tuning().verify_block == 0  # verify_plan.verify_block decides
    monkeypatch.delenv("IPC_DPSAMPLE_VERIFY_BLOCK")
    assert envs.onesided_tuning().verify_block == 0
    assert envs.onesided_tuning().verify_splits == 0  # verify_plan.verify_splits decides
    monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_SPLITS", " 3 ")
    assert envs.onesided_tuning().verify_splits == 3
    for bad in ("0", "65", "two", "1.5"):
        monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_SPLITS", bad)
        with pytest.raises(ValueError, match=r"IPC_DPSAMPLE_VERIFY_SPLITS=.*'auto' or an integer"):
            envs.onesided_tuning()
    monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_SPLITS", "AUTO")
    assert envs.onesided_tuning().verify_splits == 0
    assert envs.onesided_tuning().verify_broadcast == "auto"
    monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_BROADCAST", "OFF")
    assert envs.onesided_tuning().verify_broadcast == "off"
    monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_BROADCAST", "always")
    with pytest.raises(ValueError, match=r"IPC_DPSAMPLE_VERIFY_BROADCAST='always'.*'on'"):
        envs.onesided_tuning()
    monkeypatch.delenv("IPC_DPSAMPLE_VERIFY_BROADCAST")
    monkeypatch.delenv("IPC_DPSAMPLE_SWAP_UNROLL")
    monkeypatch.setenv("IPC_DPSAMPLE_ARGMAX_UNROLL", "3")
    with pytest.raises(ValueError, match="IPC_DPSAMPLE_ARGMAX_UNROLL"):
        envs.onesided_tuning()
    monkeypatch.delenv("IPC_DPSAMPLE_ARGMAX_UNROLL")
    assert (envs.onesided_tuning().unroll, envs.onesided_tuning().argmax_unroll) == (4, 2)


def test_importing_the_package_reads_no_tuning_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    import ipc_dpsample.backends.onesided.backend as backend

    monkeypatch.setenv("IPC_DPSAMPLE_SWAP_BLOCK", "7")  # invalid: would raise if read
    importlib.reload(backend)  # no import-time knob parsing any more


@pytest.mark.parametrize(
    ("ours", "alias", "expect"),
    [(None, "torch", "torch"), ("torch", "nccl", "torch"), (None, None, "auto")],
)
def test_tokenspeed_alias_and_precedence(
    monkeypatch: pytest.MonkeyPatch, ours: str | None, alias: str | None, expect: str
) -> None:
    from ipc_dpsample.comm import requested_backend

    for name, value in (("IPC_DPSAMPLE_BACKEND", ours), ("TOKENSPEED_DP_SAMPLING_BACKEND", alias)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert requested_backend("auto") == expect


def test_invalid_tokenspeed_alias_names_the_variable(
    world1: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ipc_dpsample import DpSamplingComm

    monkeypatch.setenv("TOKENSPEED_DP_SAMPLING_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"TOKENSPEED_DP_SAMPLING_BACKEND='fast'"):
        DpSamplingComm(
            tp_size=1, rank=0, max_pad_bs=2, num_tokens_per_req=1, vocab_size=4, device="cpu"
        )
    monkeypatch.setenv("TOKENSPEED_DP_SAMPLING_BACKEND", "torch")
    with DpSamplingComm(
        tp_size=1, rank=0, max_pad_bs=2, num_tokens_per_req=1, vocab_size=4, device="cpu"
    ) as comm:
        assert comm.explain().startswith("torch: requested explicitly")
