"""A PNG of decode-step A/B runs: per pair of profile_step reports measured in one device call
(a change and its baseline), the graph replay time of each batch shape (and MTP draft step) both report, side by
side, with the change's ratio and launch counts. Pairs from different calls sit in their own
panels: machines differ more than changes do, so only bars within a panel compare.

    python bench/tools/plot_step_ab.py --out bench/results/step_ab_32-h100.png \
        --pair "weight prefetch (03dacec vs ba313d4)" \
               "bench/results/weight_prefetch-h100.json#calls.call3.profile_new" \
               "bench/results/weight_prefetch-h100.json#calls.call3.profile_base" ...

A report is a file path, optionally with `#a.b.c`: the key path inside the JSON to a list of
profile_step rows (batch, tokens_per_row, graph_replay_us, launches_per_step), or to a whole
profile_step report (its `results`). Reads JSON only: no GPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load_rows(spec: str) -> dict[str, dict]:
    """`path#key.path` -> {shape label ("8" or "8x4"): row}."""
    path, _, keys = spec.partition("#")
    value = json.loads(Path(path).read_text())
    for key in filter(None, keys.split(".")):
        value = value[key]
    rows = value["results"] if isinstance(value, dict) else value
    return {shape_label(row): row for row in rows}


def shape_label(row: dict) -> str:
    """"8" (decode), "8x4" (verify), "8 draft" (an MTP draft step: profile_step --draft-vocab)."""
    tokens = row["tokens_per_row"]
    label = f"{row['batch']}" if tokens == 1 else f"{row['batch']}x{tokens}"
    return f"{label} draft" if row.get("step", "").startswith("draft") else label


def shape_key(label: str) -> tuple[int, int, str]:
    shape, _, kind = label.partition(" ")
    batch, _, tokens = shape.partition("x")
    return int(batch), int(tokens or 1), kind


def tick(label: str) -> str:
    batch, _, kind = label.partition(" ")
    if kind:
        return f"{kind}, {batch} row{'s' * (batch != '1')}"
    return f"{label} (verify)" if "x" in label else f"{label} row{'s' * (label != '1')}"


def plot(pairs: list[tuple[str, dict, dict]], out: Path) -> None:
    fig, axes = plt.subplots(len(pairs), 1, figsize=(9, 3.2 * len(pairs)), squeeze=False)
    for ax, (title, new, base) in zip(axes[:, 0], pairs):
        shapes = sorted(set(new) & set(base), key=shape_key)
        xs = range(len(shapes))
        width = 0.38
        ax.bar([x - width / 2 for x in xs], [base[s]["graph_replay_us"] for s in shapes], width, label="baseline",
               color="#9aa5b1")
        ax.bar([x + width / 2 for x in xs], [new[s]["graph_replay_us"] for s in shapes], width, label="change",
               color="#2f6db5")
        for x, s in zip(xs, shapes):
            ratio = new[s]["graph_replay_us"] / base[s]["graph_replay_us"]
            launches = f"{base[s]['launches_per_step']}->{new[s]['launches_per_step']}"
            ax.annotate(f"{ratio:.2f}x\n{launches}", (x, max(new[s]["graph_replay_us"], base[s]["graph_replay_us"])),
                        ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), [tick(s) for s in shapes], fontsize=8)
        ax.set_ylabel("graph replay, µs")
        ax.set_title(title, fontsize=9)
        ax.margins(y=0.25)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("0.8B-like decode / verify / draft step, change vs baseline in one call (ratio, launches)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", nargs=3, action="append", required=True, metavar=("TITLE", "CHANGE", "BASELINE"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    plot([(title, load_rows(new), load_rows(base)) for title, new, base in args.pair], args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
