"""The figures of docs/images, drawn from the JSON the benchmarks write (matplotlib: the ``plots`` extra).

    python -m benchmarks.plots accuracy PARITY.json docs/images/compression_accuracy.png
    python -m benchmarks.plots capped CAPPED.json docs/images/capped_training.png
    python -m benchmarks.plots ps_vs_ring PS.json docs/images/ps_vs_ring.png

- ``accuracy``: test accuracy against epoch, the mean over seeds, a line per configuration
  (``examples/resnet_parity.py --table compression --json``);
- ``capped``: step time against the link's rate, a line per configuration, a panel per model
  (``benchmarks.capped_training --json``);
- ``ps_vs_ring``: push+pull per step against the worker count, a line per design, measured (solid)
  beside the link-time model (dotted) (``benchmarks.ps_vs_ring --json``; ``--plot`` draws it too).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Iterator

from .capped_link import rate_bytes


@contextlib.contextmanager
def figure(path: Path, panels: int = 1, size: tuple[float, float] = (6.4, 4.0)) -> Iterator[Any]:
    """Axes to draw on (a list of ``panels``), saved to ``path`` as a PNG when the block ends."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(size[0] * panels, size[1]), dpi=100, squeeze=False)
    try:
        yield list(axes[0])
        for ax in axes[0]:
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def accuracy(report: dict, path: Path) -> None:
    """Test accuracy against epoch (``resnet_parity``'s curves), the mean over the seeds."""
    with figure(path, size=(7.5, 4.5)) as (ax,):
        import matplotlib

        ax.set_prop_cycle(color=matplotlib.colormaps["tab20"].colors)  # more lines than the default 10 colors
        for config, runs in report["curves"].items():
            epochs = min(len(run) for run in runs)
            mean = [statistics.fmean(run[e] for run in runs) for e in range(epochs)]
            ax.plot(range(1, epochs + 1), mean, marker="o", label=config, linestyle="--" if "DDP" in config else "-")
        ax.set_xlabel("epoch")
        ax.set_xticks(range(1, 1 + max(len(run) for runs in report["curves"].values() for run in runs)))
        ax.set_ylabel("test accuracy")
        ax.set_title(f"ResNet-20, 2 workers, mean of {len(report['seeds'])} seeds "
                     f"({' '.join(report['training_args']) or 'the defaults'})", fontsize=9)


def capped(report: dict, path: Path) -> None:
    """Step time against the link's rate (``capped_training``'s summary, or several runs' summaries
    joined: ``report["summary"]`` a list of them), a panel per model."""
    summary = [e for e in report["summary"] if "step_ms" in e]
    models = list(dict.fromkeys(e["model"] for e in summary))
    with figure(path, panels=len(models)) as axes:
        for ax, model in zip(axes, models):
            for config in dict.fromkeys(e["config"] for e in summary if e["model"] == model):
                points = sorted((rate_bytes(e["rate"]) * 8 / 1e6, e["step_ms"]) for e in summary
                                if e["model"] == model and e["config"] == config)
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=config,
                        linestyle="--" if "DDP" in config else "-")
            ax.set_xscale("log")
            ax.set_ylim(bottom=0)
            ax.set_xlabel("link rate (Mbit/s, each way)")
            ax.set_ylabel("training step (ms)")
            ax.set_title(f"{model}: 2 workers on capped links", fontsize=9)


def ps_vs_ring(report: dict, path: Path) -> None:
    """Push+pull per step against the workers (``ps_vs_ring``'s summary): measured solid, modelled dotted."""
    summary = report["summary"]
    with figure(path) as (ax,):
        lines: dict[str, list[dict]] = {}
        for e in summary:
            if e["design"] == "ring":
                label = "ring (-s 0)"
            else:
                label = "S = W server hosts" if e["servers"] == e["workers"] else f"S = {e['servers']} server host(s)"
            lines.setdefault(label, []).append(e)
        for label, entries in lines.items():
            done = [e for e in entries if "seconds" in e]
            line, = ax.plot([e["workers"] for e in done], [e["seconds"] for e in done], marker="o", label=label)
            ax.plot([e["workers"] for e in entries], [e["model_s"] for e in entries], linestyle=":",
                    color=line.get_color())
        ax.set_xlabel("workers (W), each on a host of its own")
        ax.set_ylabel("push + pull per step (s)")
        ax.set_title(f"{report['model_bytes'] / (1 << 20):g} MiB model, {report['rate']} links "
                     "(dotted: the link-time model)", fontsize=9)
        ax.set_xticks(sorted({e["workers"] for e in summary}))


KINDS = {"accuracy": accuracy, "capped": capped, "ps_vs_ring": ps_vs_ring}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] not in KINDS:
        print(f"usage: python -m benchmarks.plots {{{','.join(KINDS)}}} REPORT.json OUT.png", file=sys.stderr)
        return 2
    KINDS[argv[0]](json.loads(Path(argv[1]).read_text()), Path(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
