"""scripts/ncu_sass_summary.py on a small ncu source page (two kernels, gzip and plain)."""

from __future__ import annotations

import gzip
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ncu_sass_summary.py"

HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)",'
    '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed"\n'
)


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ncu_sass_summary", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def _page() -> str:
    rows = ['"Kernel Name","dp_verify_push",\n', HEADER]
    # a loop of 3 instructions run 1000 times, its load's first use stalls most
    body = [("LDG.E.128 R4, [R2]", 10, 1000), ("FSETP.NAN P0, R4, R5", 70, 1000)]
    body += [("BRA 0x10", 5, 1000), ("EXIT", 15, 10)]
    for i, (text, stalls, executed) in enumerate(body):
        rows.append(f'"0x{16 * i:x}","      {text}","{stalls}","{stalls}","{executed}"\n')
    rows += ['"Kernel Name","dp_verify_finish",\n', HEADER, '"0x0","  EXIT","3","3","1,024"\n']
    return "".join(rows)


def test_summary_ranks_windows_and_instructions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mod = _load()
    plain = tmp_path / "page.csv"
    plain.write_text(_page())
    packed = tmp_path / "page.csv.gz"
    packed.write_bytes(gzip.compress(_page().encode()))
    kernels = mod.read_kernels(_page().splitlines())
    assert [k.name for k in kernels] == ["dp_verify_push", "dp_verify_finish"]
    assert kernels[0].executed == [1000, 1000, 1000, 10] and sum(kernels[0].stalls) == 100
    assert kernels[1].executed == [1024]  # thousands separators are read
    for path in (plain, packed):
        assert mod.main([str(path), "--kernel", "push", "--window", "2", "--top", "2"]) == 0
        out = capsys.readouterr().out
        assert "dp_verify_push: 4 SASS instructions, 3010 warp instructions executed" in out
        assert "dp_verify_finish" not in out
        lines = out.splitlines()
        # the window [0, 1] holds 80 % of the stalls and 66.4 % of the instructions
        first = lines[lines.index("  windows of 2 instructions by stall samples:") + 2]
        assert first.split()[:4] == ["0", "1", "80.0%", "66.4%"]
        top = lines[lines.index("  instructions by stall samples:") + 2]
        assert top.split()[:3] == ["1", "70.0%", "1000"] and "FSETP.NAN" in top
    assert mod.main([str(plain), "--kernel", "nothing"]) == 1
    assert "no kernel name contains 'nothing'" in capsys.readouterr().err


def test_a_file_that_is_not_a_source_page_is_refused(tmp_path: Path) -> None:
    mod = _load()
    with pytest.raises(ValueError, match="no 'Address' header"):
        mod.read_kernels(["a,b,c\n", "1,2,3\n"])
    with pytest.raises(ValueError, match=r"lacks the columns \['Instructions Executed'\]"):
        mod.read_kernels(['"Address","Source","Warp Stall Sampling (All Samples)"\n'])
    with pytest.raises(SystemExit):
        mod.main([str(tmp_path / "x.csv"), "--window", "0"])
