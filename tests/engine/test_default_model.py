"""The shipped default model: HF transformers loads it (MTP aside) and its logits equal
deltaspec's on held-out code; its MTP head drafts tokens the model accepts."""

import inspect
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from deltaspec.engine import EngineConfig, LLM, SamplingParams
from deltaspec.engine.core import EngineCore

DEFAULT = Path(__file__).resolve().parents[2] / "models" / "default"
HELD_OUT_CODE = textwrap.dedent(inspect.getsource(textwrap.TextWrapper._split))  # textwrap is held out


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT)


def test_hf_loads_it_and_logits_match(llm):
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT, dtype=torch.float32).eval()
    tokens = llm.tokenizer.encode(HELD_OUT_CODE)[:300]
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    actual = llm.score(tokens)
    assert (actual - expected).abs().max() / expected.abs().max() < 1e-4
    assert llm.model.mtp is not None


def test_mtp_drafts_are_accepted(llm):
    core = EngineCore(EngineConfig(model=DEFAULT, num_draft_tokens=2, adaptive_draft_length=False))
    request = core.add_request(HELD_OUT_CODE[:600], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    while core.has_work:
        core.step()
    assert request.output_token_ids == llm.generate(HELD_OUT_CODE[:600], SamplingParams(
        max_tokens=48, temperature=0, ignore_eos=True))[0].token_ids
    assert core.stats()["spec"]["acceptance_by_position"][0] > 0.3
