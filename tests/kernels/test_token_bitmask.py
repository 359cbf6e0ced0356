"""apply_token_bitmask (kernels/token_bitmask.py): the torch reference against masks unpacked
bit by bit here (numpy's little-endian unpackbits of the int32 words), then the Triton kernel
against the reference.

Masks are random words (every bit pattern, -1 and 0 words among them), the vocabulary not a
multiple of 32 (the last word's spare bits are ignored), the output allocated NaN (`torch.empty`
poisoned) so an unwritten element fails. CPU: the interpreter, fp32/fp16/bf16 logits, several
column tiles. GPU (`gpu` marker): a 248,320 vocabulary.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltaspec.kernels import REFERENCE_OPS
from deltaspec.kernels.token_bitmask import apply_token_bitmask


def random_case(num_rows: int, vocab: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_rows, vocab, generator=gen) * 3).to(dtype)
    words = torch.randint(-2**31, 2**31, (num_rows, -(-vocab // 32)), generator=gen, dtype=torch.int64)
    words[0, 0], words[-1, -1] = -1, 0  # all allowed, none allowed
    return logits.to(device), words.to(torch.int32).to(device)


def unpacked(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = np.unpackbits(bitmask.cpu().numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab].astype(bool))


@pytest.mark.parametrize("vocab", [1, 31, 100, 257])
def test_reference_masks_exactly_the_unset_bits(vocab):
    logits, bitmask = random_case(5, vocab, torch.float32, seed=vocab)
    out = REFERENCE_OPS.apply_token_bitmask(logits, bitmask)
    allowed = unpacked(bitmask, vocab)
    assert out.dtype == torch.float32
    assert torch.equal(out[allowed], logits[allowed]) and torch.isneginf(out[~allowed]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_rows,vocab", [(0, 40), (1, 33), (3, 2048 + 77)])
def test_triton_equals_reference(kernel_device, poisoned_empty, dtype, num_rows, vocab):
    logits, bitmask = random_case(max(num_rows, 1), vocab, dtype, seed=num_rows * 7 + vocab, device=kernel_device)
    logits, bitmask = logits[:num_rows], bitmask[:num_rows]
    out = poisoned_empty(apply_token_bitmask, logits, bitmask)
    assert torch.equal(out, REFERENCE_OPS.apply_token_bitmask(logits, bitmask))


def test_triton_takes_a_strided_row_view(kernel_device, poisoned_empty):
    logits, bitmask = random_case(4, 96, torch.float32, seed=11, device=kernel_device)
    wide = torch.zeros(4, 200, device=kernel_device)
    wide[:, :96] = logits
    out = poisoned_empty(apply_token_bitmask, wide[:, :96], bitmask)
    assert torch.equal(out, REFERENCE_OPS.apply_token_bitmask(logits, bitmask))


@pytest.mark.parametrize("masking", ["reference", "triton"])
def test_in_place_on_a_float32_copy_equals_a_new_output(kernel_device, masking):
    """out = logits (the penalties' float32 working copy): masked in place, the same values as a
    new output; the returned tensor is that copy."""
    logits, bitmask = random_case(3, 2048 + 77, torch.float32, seed=13, device=kernel_device)
    apply = REFERENCE_OPS.apply_token_bitmask if masking == "reference" else apply_token_bitmask
    expected = REFERENCE_OPS.apply_token_bitmask(logits, bitmask)
    working = logits.clone()
    out = apply(working, bitmask, out=working)
    assert out.data_ptr() == working.data_ptr() and torch.equal(out, expected)


def test_bad_arguments_are_refused():
    logits, bitmask = random_case(2, 64, torch.float32, seed=1)
    for bad in (bitmask[:, :1], bitmask.to(torch.int64), bitmask[:1]):
        with pytest.raises(AssertionError):
            apply_token_bitmask(logits, bad)
    for bad_out in (torch.empty(2, 64, dtype=torch.float16), torch.empty(2, 65)[:, :64], torch.empty(1, 64)):
        with pytest.raises(AssertionError):
            apply_token_bitmask(logits, bitmask, out=bad_out)


@pytest.mark.gpu
def test_triton_at_full_vocabulary():
    logits, bitmask = random_case(64, 248_320, torch.bfloat16, seed=5, device="cuda")
    assert torch.equal(apply_token_bitmask(logits, bitmask), REFERENCE_OPS.apply_token_bitmask(logits, bitmask))
