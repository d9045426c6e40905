"""The same checks on the GPU: compiled Triton kernels, plans built on the device (run by ``nox -s gpu_tests``)."""

import pytest
import torch

from arctic_dedup import ZoRRoTrain, build_plan, pack, unpack
from arctic_dedup.plan.attention_meta import dense_tree_mask
from arctic_dedup.testing import create_dummy_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("sharing", ["prompt", "trie"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_plan_and_pack_on_the_gpu_match_the_cpu(sharing: str, dtype: torch.dtype) -> None:
    batch = create_dummy_batch(64, 8, 300, 120, add_padding=True, seed=5)
    cpu_plan = build_plan(batch["input_ids"], 120, batch["attention_mask"], sharing=sharing)  # type: ignore[arg-type]
    cuda_batch = {name: tensor.cuda() for name, tensor in batch.items()}
    plan = build_plan(cuda_batch["input_ids"], 120, cuda_batch["attention_mask"], sharing=sharing)  # type: ignore[arg-type]
    assert torch.equal(plan.token_ids.cpu(), cpu_plan.token_ids)
    assert torch.equal(plan.kv_visible_until.cpu(), cpu_plan.kv_visible_until)
    packed = torch.randn(plan.num_packed_tokens, 4, 64, device="cuda", dtype=dtype, requires_grad=True)
    padded = unpack(packed, plan, padded=True)
    assert torch.equal(padded, unpack(packed, plan, padded=True, backend="torch"))
    assert torch.equal(pack(padded, plan, padded=True), packed)
    weights = torch.randn_like(padded)
    (grad,) = torch.autograd.grad((padded.float() * weights.float()).sum(), packed)
    expected = torch.zeros(packed.shape, device="cuda", dtype=torch.float32)
    mask = cuda_batch["attention_mask"].bool()
    expected.index_add_(0, plan.unpack_map.gather_index, weights[mask].float())
    torch.testing.assert_close(grad.float(), expected.to(dtype).float(), rtol=1e-2, atol=1e-2)


def test_dense_mask_and_facade_on_the_gpu() -> None:
    batch = {k: v.cuda() for k, v in create_dummy_batch(16, 4, 40, 20, add_padding=True).items()}
    plan = build_plan(batch["input_ids"], 20, batch["attention_mask"])
    mask = dense_tree_mask(plan.kv_visible_until)
    assert int(mask.sum()) > 0
    groups, prompts = ZoRRoTrain.find_prompt_groups(batch["input_ids"], 20, batch["attention_mask"])
    ids, _, info = ZoRRoTrain.create_deduplicated_batch(
        batch["input_ids"], batch["position_ids"], 20, groups, prompts, batch["attention_mask"], use_unpad=True
    )
    rebuilt = ZoRRoTrain.reconstruct_sequences(ids[..., None], info)[0, :, 0]
    assert torch.equal(rebuilt, batch["input_ids"][batch["attention_mask"].bool()])
