"""Turn a ``fit`` checkpoint of a full fine-tune of the toy model into a toy checkpoint (``.safetensors``),
so that another run starts from it: ``--model.init_args.policy.init_args.pretrained=<out>`` (SFT, then
Flow-GRPO from what SFT learnt).

    python -m lit_flowgrpo.toy.from_fit runs/quickstart_sft/checkpoints/last.ckpt runs/sft_base.safetensors

The checkpoint holds the trained U-Net's weights (``policy.unet.*``; a full fine-tune); the text encoder
is the base checkpoint's, which fine-tuning leaves frozen. Written in float32, so nothing the fine-tune
learnt is rounded away.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from lit_flowgrpo.toy.model import save_checkpoint
from lit_flowgrpo.toy.policy import ToyPolicy

__all__ = ["main", "toy_checkpoint_from_fit"]

_PREFIX = "policy.unet."


def toy_checkpoint_from_fit(ckpt_path: str, out: str, base: str | None = None) -> int:
    """Write ``out`` from the U-Net weights of ``ckpt_path`` over the toy ``base`` (``None``: the shipped
    one); returns the number of tensors taken from the checkpoint."""
    policy = ToyPolicy(pretrained=base, dtype="float32")
    policy.load()
    state = torch.load(ckpt_path, map_location="cpu", weights_only=True)["state_dict"]
    unet = {k[len(_PREFIX) :]: v for k, v in state.items() if k.startswith(_PREFIX)}
    if not unet:
        raise ValueError(
            f"{ckpt_path} holds no {_PREFIX}* weights: it is not a full fine-tune of the toy model "
            "(a LoRA run's adapter cannot stand for the base)"
        )
    policy.unet.load_state_dict(unet, strict=True)
    save_checkpoint(out, policy.unet, policy.text_encoder, dtype=torch.float32, info={"from_fit": ckpt_path})
    return len(unet)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt_path", help="a fit checkpoint of a full fine-tune of the toy model")
    parser.add_argument("out", help="the .safetensors file to write")
    parser.add_argument(
        "--base", default=None, help="the toy checkpoint the run started from (default: shipped)"
    )
    args = parser.parse_args(argv)
    n = toy_checkpoint_from_fit(args.ckpt_path, args.out, args.base)
    print(f"wrote {args.out} ({n} U-Net tensors from {args.ckpt_path})")


if __name__ == "__main__":
    main()
