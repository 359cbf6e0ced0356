"""The `deltaspec` command line: `deltaspec generate "prompt"` prints a completion.

Knows nothing about models beyond the engine's public API.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..engine import LLM, SamplingParams

# The shipped demonstration model (models/default in a source checkout).
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "default"


def _generate(args: argparse.Namespace) -> int:
    model = Path(args.model)
    if not (model / "config.json").exists():
        print(f"deltaspec: no model at {model} (pass --model PATH to an HF-format checkpoint)", file=sys.stderr)
        return 2
    llm = LLM(model, device=args.device, dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    output = llm.generate(args.prompt, params)[0]
    print(args.prompt + output.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltaspec")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="print a completion of PROMPT")
    generate.add_argument("prompt")
    generate.add_argument("--model", default=str(DEFAULT_MODEL))
    generate.add_argument("--device", default="cpu")
    generate.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.set_defaults(run=_generate)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ValueError as e:
        print(f"deltaspec: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
