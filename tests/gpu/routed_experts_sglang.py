"""Real SGLang's routed experts (MoE routing replay), for a machine with a CUDA GPU and SGLang.

NOT RUN YET: no GPU has been lent. SGLang 0.5.23's CPU engine cannot start with
--enable-return-routed-experts: its capture buffer registers pinned host memory through
torch.cuda.cudart() (sglang/srt/state_capturer/base.py BaseHostCache ->
sglang/srt/mem_cache/pool_host/common.py _cuda_host_register), which a CPU torch refuses
("Torch not compiled with CUDA enabled"). On a GPU this script serves a tiny Qwen3-MoE in fp32,
asks for routed experts over HTTP and checks their shape ([prompt + response - 1, layers,
top-k]) and values against transformers' own router top-k of the same sequence.

fp32 needs an attention backend that takes it (issue 38, defect 7): on Hopper SGLang 0.5.23
picks FA3, which takes fp16/bf16/fp8 only (flashinfer the same), so the server runs
``--attention-backend torch_native`` (torch's scaled_dot_product_attention, any dtype; one of
sglang/srt/arg_groups/choices.py ATTENTION_BACKEND_CHOICES, the backend the CPU interop tier
uses; SGLang disables CUDA graphs with it). fp32 keeps the routers' inputs as close to
transformers' fp32 as SGLang allows: its Triton fused-MoE kernel still rounds expert outputs
to fp16 in an fp32 model (moe_runner/triton_utils/fused_moe.py ``compute_type``), so a
router top-k that is a near-tie may differ; the script prints the layer that differs.

  python tests/gpu/routed_experts_sglang.py [--python /path/to/sglang/python]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the worktree's package

from megatron_klear.models.tiny import save_tiny_hf_model  # noqa: E402
from megatron_klear.rollout.orchestration.client import RolloutClient, SamplingParams  # noqa: E402
from megatron_klear.rollout.engine.launcher import launch_sglang_servers  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default=sys.executable, help="the interpreter with sglang")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    root = Path(tempfile.mkdtemp(prefix="r3-gpu-"))
    hf = save_tiny_hf_model(root / "hf", moe=True, std=0.2, seed=0)
    prompt = [5, 6, 7, 8, 9]
    with launch_sglang_servers(hf, 1, log_dir=root, python=args.python,
                               extra_args=["--dtype", "float32", "--attention-backend",
                                           "torch_native", "--enable-return-routed-experts"]
                               ) as servers:
        params = SamplingParams(n=1, max_new_tokens=6, return_routed_experts=True)
        gen = RolloutClient(servers.urls).generate([prompt], params)[0][0]
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    seq = prompt + gen.output_ids
    got = gen.routed_experts.view(len(seq) - 1, model.config.num_hidden_layers, -1)
    seen = {}
    for j, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(lambda m, i, o, j=j: seen.__setitem__(j, o[2]))
    with torch.no_grad():
        model(input_ids=torch.tensor([seq[:-1]]))
    for j, ids in seen.items():
        same = torch.equal(got[:, j].long().sort(-1).values, ids.sort(-1).values)
        print(f"layer {j}: SGLang's experts {'equal' if same else 'DIFFER from'} transformers'")
        if not same:
            sys.exit(1)
    print("routed experts: shape", tuple(got.shape), "ok")


if __name__ == "__main__":
    main()
