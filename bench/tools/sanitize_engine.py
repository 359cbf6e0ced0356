"""The engine's eager GPU path for compute-sanitizer (bench/tools/sanitize.sh): the shipped
model in bf16 with CUDA graphs and the start-up warm-up off, speculation on (MTP draft, verify,
acceptance) beside plain rows, greedy and sampled, a prompt sharing a cached prefix. Exits 0
when every request finished with its tokens; the sanitizer judges the memory accesses."""

from pathlib import Path

from deltaspec.engine import LLM, SamplingParams

MODEL = Path(__file__).resolve().parents[2] / "models" / "default"


def main() -> int:
    llm = LLM(MODEL, device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=8, num_draft_tokens=2,
              enable_cuda_graphs=False, warm_up=False)
    prompts = ["def fibonacci(n):", "import os\nimport sys\n\ndef main(argv):\n" * 8, "class Cache:\n    def get(",
               "def fibonacci(n):\n    if n < 2:"]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=1, ignore_eos=True)] * 2
    outputs = llm.generate(prompts, params)
    assert all(len(output.token_ids) == 24 for output in outputs), [len(o.token_ids) for o in outputs]
    print("engine_eager: ok", [output.text[:20] for output in outputs])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
