"""`python -m runtime.app.diff A B [--tol 2e-2]`: compare two attention-dump folders (see runtime/model/dump.py).

For every ``attn_<mode>.pt`` in both folders and every key, prints the relative error
``||a - b|| / ||b||`` and the max absolute difference; exits 1 if any tensor differs beyond ``--tol``, a
shape or scalar differs, or a file/key is present in one folder only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table


def compare_dumps(a: Path, b: Path, tol: float) -> tuple[list[tuple[str, str, str, float, float, bool]], list[str]]:
    """Rows (file, key, kind, rel_err, max_abs, ok) and problems (missing files/keys, shape mismatches)."""
    rows, problems = [], []
    files_a = {p.name for p in a.glob("attn_*.pt")}
    files_b = {p.name for p in b.glob("attn_*.pt")}
    for name in sorted(files_a ^ files_b):
        problems.append(f"{name} only in {a if name in files_a else b}")
    if not files_a & files_b:
        problems.append(f"no attn_*.pt file common to {a} and {b}")
    for name in sorted(files_a & files_b):
        da, db = torch.load(a / name), torch.load(b / name)
        for key in sorted(set(da) ^ set(db)):
            problems.append(f"{name}: key '{key}' only in one dump")
        for key in sorted(set(da) & set(db)):
            va, vb = da[key], db[key]
            if torch.is_tensor(va) and torch.is_tensor(vb):
                if va.shape != vb.shape:
                    problems.append(f"{name}:{key}: shape {tuple(va.shape)} vs {tuple(vb.shape)}")
                    continue
                fa, fb = va.double(), vb.double()
                diff = (fa - fb).abs()
                max_abs = float(diff.max()) if diff.numel() else 0.0
                denom = float(torch.linalg.vector_norm(fb))
                rel = float(torch.linalg.vector_norm(fa - fb)) / denom if denom > 0 else max_abs
                ok = rel <= tol and not torch.isnan(fa).any() and not torch.isnan(fb).any()
                rows.append((name, key, "tensor", rel, max_abs, bool(ok)))
            else:
                same = va == vb if not isinstance(va, float) else abs(va - vb) <= 1e-12 * max(1.0, abs(vb))
                rows.append((name, key, type(va).__name__, 0.0 if same else float("inf"), 0.0, bool(same)))
    return rows, problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime.app.diff", description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--tol", type=float, default=2e-2, help="max relative error per tensor (default 2e-2)")
    args = ap.parse_args(argv)
    for d in (args.a, args.b):
        if not d.is_dir():
            print(f"dump folder {d}: not found; expected a folder written by +dump_dir=...", file=sys.stderr)
            return 2
    rows, problems = compare_dumps(args.a, args.b, args.tol)
    t = Table(title=f"{args.a} vs {args.b}")
    for col in ("file", "key", "kind", "rel err", "max |a-b|", "ok"):
        t.add_column(col)
    for name, key, kind, rel, mx, ok in rows:
        t.add_row(name, key, kind, f"{rel:.3e}", f"{mx:.3e}", "yes" if ok else "[red]NO[/red]")
    Console().print(t)
    for p in problems:
        print(f"problem: {p}", file=sys.stderr)
    bad = problems or [r for r in rows if not r[5]]
    print("dumps differ" if bad else "dumps match", file=sys.stderr if bad else sys.stdout)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
