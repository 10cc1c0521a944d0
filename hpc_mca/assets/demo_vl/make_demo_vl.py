"""Regenerate the vision-language demo next to this file (deterministic; the output is committed).

    .venv/bin/python hpc_mca/assets/demo_vl/make_demo_vl.py [--out DIR]

Writes, without any network access, a tiny Qwen2-VL "model directory" and a dataset it can
learn from:

* ``tokenizer.json`` + ``tokenizer_config.json``: the character-level demo tokenizer
  (``hpc_mca/assets/demo``) with Qwen2-VL's special tokens added (``<|im_start|>``,
  ``<|im_end|>``, ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``,
  ``<|video_pad|>``), for the ``qwen2_vl`` template.
* ``preprocessor_config.json``: transformers' Qwen2-VL image processor (patch 14, merge 2; the
  PIL backend loads without torchvision).
* ``config.json``: a tiny ``qwen2_vl`` model (transformers' ``Qwen2VLConfig``: hidden 64, 2
  layers, vision depth 2, vision width 32) whose token ids are the tokenizer's.
* ``data/``: ``dataset_info.json`` (LLaMA-Factory's format, entry ``shapes``: sharegpt with an
  ``images`` column) and ``shapes.json``, questions about small drawn images of coloured shapes
  in ``data/images/`` (the colour, the shape, or whether two images share a colour): answers
  that only the image tells. Entry ``shapes_pref`` (``ranking: true``, sharegpt with ``chosen``,
  ``rejected`` and ``images``), ``shapes_pref.json``: preference pairs over the same images, the
  right colour or shape chosen and a wrong answer rejected (of the other kind, or, in one pair
  of three, another colour or shape).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer

from hpc_mca.assets.demo.make_demo import build_tokenizer

if TYPE_CHECKING:
    from PIL import Image

VL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
             "<|video_pad|>"]
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 50), "blue": (40, 60, 220), "yellow": (235, 210, 30)}
COLOURS_LIST = tuple(COLOURS)
SHAPES = ("square", "circle", "triangle")
SIZES = ((56, 56), (84, 56))
"""Image sizes (width, height): 2×2 and 3×2 merged patches of 28 pixels, 4 and 6 image tokens."""
RECORDS = 240
PAIRS = 60
SEED = 63
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def build_vl_tokenizer() -> Tokenizer:
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VL_TOKENS])
    return tokenizer


def tokenizer_config() -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "unk_token": "<unk>",
            "eos_token": "<|im_end|>", "model_max_length": 256, "padding_side": "right",
            "clean_up_tokenization_spaces": False}


def preprocessor_config() -> dict:
    return {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
            "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 56 * 56,
            "max_pixels": 28 * 28 * 1280, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True}


def model_config(tokenizer: Tokenizer) -> dict:
    from transformers import Qwen2VLConfig

    vocab = tokenizer.get_vocab()
    ids: dict[str, Any] = {"bos_token_id": None, "eos_token_id": vocab["<|im_end|>"], "pad_token_id": vocab["<pad>"]}
    config = Qwen2VLConfig(
        text_config={"vocab_size": tokenizer.get_vocab_size(), "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 512, "rope_parameters": {
                         "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}, **ids},
        vision_config={"depth": 2, "embed_dim": 32, "num_heads": 2, "hidden_size": 64, "mlp_ratio": 2,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3},
        image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"],
        tie_word_embeddings=False, architectures=["Qwen2VLForConditionalGeneration"], **ids)
    return config.to_diff_dict()


def draw(colour: str, shape: str, size: tuple[int, int]) -> Image.Image:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, (245, 245, 245))
    pen = ImageDraw.Draw(image)
    w, h = size
    box = (w // 2 - 20, h // 2 - 20, w // 2 + 20, h // 2 + 20)
    fill = COLOURS[colour]
    if shape == "square":
        pen.rectangle(box, fill=fill)
    elif shape == "circle":
        pen.ellipse(box, fill=fill)
    else:
        pen.polygon([(box[0], box[3]), (box[2], box[3]), (w // 2, box[1])], fill=fill)
    return image


def image_name(colour: str, shape: str, size: tuple[int, int]) -> str:
    return f"images/{colour}_{shape}_{size[0]}x{size[1]}.png"


def records(rng: random.Random) -> list[dict]:
    kinds = [(c, s, z) for c in COLOURS for s in SHAPES for z in SIZES]
    out = []
    for index in range(RECORDS):
        first = rng.choice(kinds)
        if index % 3 == 2:  # two images: same colour?
            second = rng.choice(kinds)
            question, answer = "<image><image>Same colour?", "yes" if first[0] == second[0] else "no"
            images = [image_name(*first), image_name(*second)]
        elif index % 3 == 1:
            question, answer, images = "<image>What shape is it?", first[1], [image_name(*first)]
        else:
            question, answer, images = "What colour is <image> this?", first[0], [image_name(*first)]
        out.append({"messages": [{"role": "user", "content": question},
                                 {"role": "assistant", "content": answer}], "images": images})
    return out


def pairs(rng: random.Random) -> list[dict]:
    """Questions whose chosen answer is the image's colour or shape. The rejected answer is of
    the other kind (a shape for a colour question: the question tells) for two pairs in three,
    and another colour or shape (only the image tells) for the third."""
    out = []
    for index in range(PAIRS):
        colour, shape, size = rng.choice(COLOURS_LIST), rng.choice(SHAPES), rng.choice(SIZES)
        others: tuple[tuple[str, ...], tuple[str, ...]]
        if index % 2:
            question, right, others = "<image>What shape is it?", shape, (SHAPES, COLOURS_LIST)
        else:
            question, right, others = "What colour is <image> this?", colour, (COLOURS_LIST, SHAPES)
        same_kind = index % 3 == 2
        wrong = rng.choice([a for a in others[0] if a != right]) if same_kind else rng.choice(others[1])
        out.append({"messages": [{"role": "user", "content": question}],
                    "chosen": {"role": "assistant", "content": right},
                    "rejected": {"role": "assistant", "content": wrong},
                    "images": [image_name(colour, shape, size)]})
    return out


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def main(out: Path) -> None:
    (out / "data" / "images").mkdir(parents=True, exist_ok=True)
    tokenizer = build_vl_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", tokenizer_config())
    write_json(out / "preprocessor_config.json", preprocessor_config())
    write_json(out / "config.json", model_config(tokenizer))
    for colour in COLOURS:
        for shape in SHAPES:
            for size in SIZES:
                draw(colour, shape, size).save(out / "data" / image_name(colour, shape, size), optimize=True)
    lines = ",\n".join(json.dumps(record) for record in records(random.Random(SEED)))
    (out / "data" / "shapes.json").write_text(f"[\n{lines}\n]\n")
    preferred = ",\n".join(json.dumps(record) for record in pairs(random.Random(SEED + 1)))
    (out / "data" / "shapes_pref.json").write_text(f"[\n{preferred}\n]\n")
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    write_json(out / "data" / "dataset_info.json", {
        "shapes": {"file_name": "shapes.json", "formatting": "sharegpt",
                   "columns": {"messages": "messages", "images": "images"}, "tags": tags},
        "shapes_pref": {"file_name": "shapes_pref.json", "formatting": "sharegpt", "ranking": True,
                        "columns": {"messages": "messages", "chosen": "chosen", "rejected": "rejected",
                                    "images": "images"}, "tags": tags}})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    main(parser.parse_args().out)
