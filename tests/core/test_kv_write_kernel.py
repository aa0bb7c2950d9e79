"""The one-launch Triton KV write (attnplug.core.kernels.kv_write) against the core's write_kv, on
vLLM-style strided views: random slots, padding slots, extra rows, dtype cast, page sizes 1/16."""

import pytest
import torch

from attnplug.core.kernels.kv_write import write_kv_paged
from attnplug.core.kv_layout import write_kv, write_kv_fixed_shape

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # conftest: interpreter without CUDA


def fixed_shape(k, v, kc, vc, slots):
    write_kv_fixed_shape(k, v, kc, vc, slots, kc.shape[0] - 1)  # last page: never a target below


@pytest.mark.parametrize("write", [write_kv_paged, fixed_shape], ids=["triton", "fixed_shape"])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)])
def test_matches_write_kv_on_vllm_strided_cache(write, page, idx_dtype, dtypes):
    # (float32 -> bfloat16 casts are not compared: the Triton interpreter rounds them differently
    # from torch; float16 casts round the same)
    src, dst = dtypes
    g = torch.Generator().manual_seed(page)
    pages, H, D, T = 20, 2, 64, 13
    # vLLM's layout: one [2, pages, P, H, D] tensor, K and V are its halves (strided views)
    base = torch.randn(2, pages, page, H, D, generator=g).to(dst).to(DEV)
    want = base.clone()
    slots = torch.randperm((pages - 1) * page, generator=g)[:T]
    slots[[2, 7]] = -1  # padding tokens
    slots = slots.to(idx_dtype).to(DEV)
    kv = torch.randn(T + 3, 2 * H, D, generator=g).to(src).to(DEV)  # [k | v] heads, 3 extra rows
    k, v = kv[:, :H], kv[:, H:]
    write_kv(k[:T], v[:T], want[0], want[1], slots)
    write(k, v, base[0], base[1], slots)
    assert torch.equal(base, want)


def test_empty_and_non_contiguous_head_dim():
    cache = torch.zeros(2, 4, 16, 2, 8, dtype=torch.float16, device=DEV)
    write_kv_paged(
        torch.ones(0, 2, 8, device=DEV),
        torch.ones(0, 2, 8, device=DEV),
        cache[0],
        cache[1],
        torch.zeros(0, dtype=torch.int32, device=DEV),
    )
    assert not cache.any()
    k = torch.ones(3, 8, 2, device=DEV).transpose(1, 2)  # head dim stride 2
    with pytest.raises(ValueError, match="k must have a contiguous head dim"):
        write_kv_paged(k, k, cache[0], cache[1], torch.tensor([0, 1, 2], device=DEV))
