"""Write a checkpoint's draft_vocab.json (format: spec/draft_vocab.py): its token ids by
frequency on a calibration corpus, most frequent first. With `draft_vocab_size=N` the engine's MTP drafts only from the first N
(a smaller lm_head read per draft step; the target still verifies every draft).

    python bench/tools/draft_vocab.py --model models/default [--corpus FILE ...]

Default corpus: the standard library of this interpreter minus the default model's held-out
modules (bench/tools/train_default_model.py), i.e. text like the model's training data.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from deltaspec.engine.tokenizer import Tokenizer
from deltaspec.spec import write_draft_vocab
from train_default_model import corpus_files, read


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=Path("models/default"))
    parser.add_argument("--corpus", type=Path, nargs="*", default=[])
    args = parser.parse_args()
    tokenizer = Tokenizer.from_dir(args.model)
    files = args.corpus or corpus_files(0)[0]
    counts: Counter[int] = Counter()
    for text in tqdm(read(files), desc="counting tokens"):
        counts.update(tokenizer.encode(text))
    ranked = [token for token, _ in counts.most_common()]
    out = write_draft_vocab(args.model, ranked, len(files), sum(counts.values()))
    covered = lambda n: sum(c for _, c in counts.most_common(n)) / sum(counts.values())
    print(f"wrote {out}: {len(ranked)} tokens seen; the top 1024 cover {covered(1024):.1%}, "
          f"the top 2048 {covered(2048):.1%}")


if __name__ == "__main__":
    main()
