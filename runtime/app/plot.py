"""``steps.png``: step latency over a run by phase, and the GPU's idle time between steps where measured.

Needs matplotlib (the ``plot`` extra: ``pip install -e .[plot]``); without it :func:`write_step_plot` returns
None and the caller says the plot was skipped.

Latency is each StepRecord's ``seconds`` (device time between its start and end marks). Idle between two
consecutive records is measured only on a GPU (their marks are CUDA events): the time from one record's end
event to the next one's start event on the GPU timeline. It is a lower bound on the idle time: a record's
start is marked before its host planning, so a wait for the host inside a record counts as its latency.
"""

from __future__ import annotations

from pathlib import Path

from runtime.engine.engine import RunResult

PHASE_COLORS = {
    "prefill": "tab:blue", "decode": "tab:green", "draft_prefill": "tab:cyan", "draft_bootstrap": "tab:olive",
    "draft_decode": "tab:purple", "target_verify": "tab:red", "draft_extend": "tab:orange",
}


def idle_ms(steps: list, gpu_marks: bool) -> list[float | None]:
    """GPU idle (ms) before each step after the first: from the previous record's end event to this one's
    start event; None where not measured (``gpu_marks`` false: the marks are host clock values, not GPU time)."""
    out: list[float | None] = []
    for prev, cur in zip(steps[:-1], steps[1:]):
        if gpu_marks and len(prev.marks) == 2 and len(cur.marks) == 2:
            out.append(max(0.0, prev.marks[1].elapsed_time(cur.marks[0])))
        else:
            out.append(None)
    return out


def write_step_plot(res: RunResult, out_dir: Path) -> Path | None:
    """Write ``out_dir/steps.png``; None when matplotlib is not installed (nothing else changes)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [s for s in res.steps if s.marks]
    idle = idle_ms(steps, res.gpu_marks)
    measured = [(i + 1, v) for i, v in enumerate(idle) if v is not None]
    fig, axes = plt.subplots(2 if measured else 1, 1, figsize=(11, 6.5 if measured else 4), sharex=True,
                             squeeze=False)
    ax = axes[0][0]
    for phase in dict.fromkeys(s.phase for s in steps):
        xs = [i for i, s in enumerate(steps) if s.phase == phase]
        ax.scatter(xs, [steps[i].seconds * 1e3 for i in xs], s=8, label=phase, color=PHASE_COLORS.get(phase))
    ax.set_ylabel("step latency (ms)")
    ax.set_yscale("log")
    ax.legend(loc="upper right", fontsize=8, ncol=4)
    ax.set_title(f"{len(steps)} steps" + ("" if measured else " (GPU idle not measured: no CUDA events)"))
    if measured:
        busy = sum(s.seconds for s in steps) * 1e3
        total_idle = sum(v for _, v in measured)
        ax2 = axes[1][0]
        ax2.bar([i for i, _ in measured], [v * 1e3 for _, v in measured], width=1.0, color="tab:gray")
        ax2.set_ylabel("GPU idle before step (us)")
        ax2.set_title(f"GPU busy {busy:.1f} ms, idle between steps {total_idle:.2f} ms "
                      f"({total_idle / max(busy + total_idle, 1e-9):.1%})")
    axes[-1][0].set_xlabel("step (launch order)")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "steps.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
