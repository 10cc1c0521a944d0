"""Vision-language data (issue #63): samples, grids and pixels equal LLaMA-Factory 0.9.5's own
(its ``qwen2_vl`` / ``qwen3_vl`` templates with their Qwen2-VL / Qwen3-VL mm plugins and its
supervised processor) on images drawn here; M-RoPE positions equal transformers'
``get_rope_index``; bad input is one line naming the sample; packed rows carry their samples'
pixels in token order.

The processors are built locally: the demo_vl tokenizer with transformers' Qwen2-VL image
processor (PIL backend, no torchvision) configured as Qwen2-VL / Qwen2.5-VL (patch 14, CLIP
normalisation) or Qwen3-VL (patch 16, normalisation 0.5, its larger minimum size) ship theirs.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lf_peer import lf_data_args, lf_get_template_and_fix_tokenizer, lf_supervised
from PIL import Image, ImageDraw

from hpc_mca.data.arguments import DataArguments, DataRun
from hpc_mca.data.batch import PackedBatch, collate_batch
from hpc_mca.data.conversation import Example
from hpc_mca.data.dataset import build_datasets
from hpc_mca.data.encode import prepare_template
from hpc_mca.data.errors import DataError
from hpc_mca.data.mrope import rope_index
from hpc_mca.data.multimodal import vision_inputs, vision_sample
from hpc_mca.data.rows import collate_rows
from hpc_mca.data.tokenize import load_tokenizer
from hpc_mca.data.vision import ImageSettings, image_inputs

DEMO_VL = Path(__file__).resolve().parents[1] / "hpc_mca" / "assets" / "demo_vl"
CLIP = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
PROCESSORS = {  # family -> (template, preprocessor_config.json as the family's checkpoints ship it)
    "qwen2_vl": ("qwen2_vl", {"patch_size": 14, "min_pixels": 3136, "max_pixels": 12845056, **CLIP}),
    "qwen2_5_vl": ("qwen2_vl", {"patch_size": 14, "min_pixels": 3136, "max_pixels": 12845056, **CLIP,
                                "processor_class": "Qwen2_5_VLProcessor"}),
    "qwen3_vl": ("qwen3_vl", {"patch_size": 16, "size": {"shortest_edge": 65536, "longest_edge": 16777216},
                              "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "processor_class": "Qwen3VLProcessor"}),
}
SIZES = [((56, 56), "RGB"), ((100, 37), "RGBA"), ((300, 20), "L"), ((8, 8), "RGB"), ((30, 6500), "RGB"),
         ((1000, 800), "P")]
"""Square, odd sides and alpha, a side under 28, under image_min_pixels, an aspect above 200,
above image_max_pixels (and a palette image)."""


def _model_dir(root: Path, family: str) -> Path:
    out = root / family
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(DEMO_VL / name, out / name)
    config = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
              "temporal_patch_size": 2, "merge_size": 2, **PROCESSORS[family][1]}
    (out / "preprocessor_config.json").write_text(json.dumps(config))
    return out


def _draw(path: Path, size: tuple[int, int], mode: str, seed: int) -> str:
    rng = np.random.default_rng(seed)
    image = Image.new("RGB", size, tuple(int(v) for v in rng.integers(0, 255, 3)))
    pen = ImageDraw.Draw(image)
    for _ in range(4):
        x, y = int(rng.integers(0, size[0])), int(rng.integers(0, size[1]))
        pen.rectangle((x, y, x + size[0] // 3, y + size[1] // 3), fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    image.convert(mode).save(path)
    return str(path)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("images")
    return [_draw(root / f"{i}.png", size, mode, i) for i, (size, mode) in enumerate(SIZES)]


def _conversations(images: list[str]) -> list[tuple[list[dict], list[str], str]]:
    """(messages, images, system): one image, two in one turn, images over several turns."""
    return [
        ([{"role": "user", "content": "<image>What is this?"}, {"role": "assistant", "content": "a box"}],
         images[:1], ""),
        ([{"role": "user", "content": "Compare <image> and <image>, please"}, {"role": "assistant", "content": "same"}],
         images[1:3], "look closely"),
        ([{"role": "user", "content": "<image>first"}, {"role": "assistant", "content": "one"},
          {"role": "user", "content": "then<image> and <image>"}, {"role": "assistant", "content": "two and three"}],
         [images[3], images[4], images[5]], ""),
        ([{"role": "user", "content": "no image here"}, {"role": "assistant", "content": "fine"}], [], ""),
    ]


def _lf_processor(image_processor, settings: ImageSettings) -> SimpleNamespace:
    # LLaMA-Factory reads the image processor, the video processor's merge size (Qwen3-VL) and
    # the sizing settings it patches onto the processor.
    return SimpleNamespace(image_processor=image_processor, video_processor=image_processor,
                           image_max_pixels=settings.max_pixels, image_min_pixels=settings.min_pixels)


@pytest.mark.parametrize("family", sorted(PROCESSORS))
@pytest.mark.parametrize("mask_history", [False, True])
def test_samples_grids_and_pixels_equal_llamafactorys(family, mask_history, images, tmp_path):
    template_name = PROCESSORS[family][0]
    model = _model_dir(tmp_path, family)
    settings = ImageSettings(max_pixels=300 * 300, min_pixels=32 * 32)
    base = load_tokenizer(model)
    ours_tok, lf_tok = copy.deepcopy(base), copy.deepcopy(base)
    data = DataArguments(template=template_name, mask_history=mask_history)
    template = prepare_template(ours_tok, data)
    vision = vision_inputs(ours_tok, template, model, settings)
    lf_template = lf_get_template_and_fix_tokenizer(lf_tok, template=template_name)
    processor = _lf_processor(vision.processor, settings)
    args = lf_data_args(template=template_name, cutoff_len=4096, mask_history=mask_history)
    lf = lf_supervised.SupervisedDatasetProcessor(template=lf_template, tokenizer=lf_tok, processor=processor,
                                                  data_args=args)
    for messages, paths, system in _conversations(images):
        example = Example("memory", messages[:-1], messages[-1:], system, "", tuple(paths))
        built = vision_sample(template, ours_tok, example, 4096, vision, mask_history=mask_history)
        ids, labels = lf._encode_data_example(messages[:-1], messages[-1:], system or None, None, paths, [], [])
        assert (built.tokens, built.labels) == (ids, labels)
        if not paths:
            continue
        pixels, grids = vision.pixels(tuple(paths), "memory")
        expected = lf_template.mm_plugin._get_mm_inputs(paths, [], [], processor)
        assert np.array_equal(grids, expected["image_grid_thw"].numpy())
        assert np.array_equal(pixels, expected["pixel_values"].numpy())
        assert [tuple(g) for g in grids.tolist()] == list(built.grids)
        assert built.tokens.count(vision.image_token_id) == int(grids.prod(axis=1).sum()) // 4


def _rope_models() -> dict:
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLModel,
        Qwen2VLConfig,
        Qwen2VLModel,
        Qwen3VLConfig,
        Qwen3VLModel,
    )

    text = {"vocab_size": 120, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1}
    vision = {"depth": 1, "num_heads": 2, "spatial_merge_size": 2}
    mrope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    ids = {"image_token_id": 106, "video_token_id": 107, "vision_start_token_id": 104}
    return {
        "qwen2_vl": Qwen2VLModel(Qwen2VLConfig(text_config={**text, "rope_parameters": mrope},
                                               vision_config={**vision, "embed_dim": 16, "hidden_size": 32}, **ids)),
        "qwen2_5_vl": Qwen2_5_VLModel(Qwen2_5_VLConfig(text_config={**text, "rope_parameters": mrope},
                                                       vision_config={**vision, "hidden_size": 16,
                                                                      "out_hidden_size": 32, "intermediate_size": 32},
                                                       **ids)),
        "qwen3_vl": Qwen3VLModel(Qwen3VLConfig(
            text_config={**text, "head_dim": 16, "rope_parameters": {**mrope, "mrope_section": [2, 3, 3]}},
            vision_config={**vision, "hidden_size": 16, "out_hidden_size": 32, "intermediate_size": 32,
                           "num_position_embeddings": 16, "deepstack_visual_indexes": []}, **ids)),
    }


def test_mrope_positions_equal_transformers_get_rope_index():
    rng = np.random.default_rng(0)
    models = _rope_models()
    image, start, end = 106, 104, 105
    for grids in ([], [[1, 4, 4]], [[1, 2, 6], [1, 8, 2]], [[1, 6, 6], [1, 2, 2], [1, 4, 10]]):
        for lead in (0, 3):
            ids: list[int] = list(rng.integers(6, 90, lead))
            for t, h, w in grids:
                ids += [start] + [image] * (t * h * w // 4) + [end] + list(rng.integers(6, 90, 5))
            ids += list(rng.integers(6, 90, 4))
            ours = rope_index(np.asarray(ids), np.asarray(grids, dtype=np.int64).reshape(-1, 3), image, 2)
            tensor = torch.tensor([ids])
            for family, model in models.items():
                theirs, _ = model.get_rope_index(tensor, (tensor == image).int(),
                                                 torch.tensor(grids, dtype=torch.long) if grids else None)
                assert np.array_equal(ours, theirs[:, 0].numpy()), (family, grids, lead)


# --- bad input ---------------------------------------------------------------------------


def _demo_copy(tmp_path: Path, records: list[dict], media: dict[str, str] | None = None) -> Path:
    data = tmp_path / "data"
    shutil.copytree(DEMO_VL / "data", data)
    (data / "bad.json").write_text(json.dumps(records))
    info = json.loads((data / "dataset_info.json").read_text())
    columns = {"messages": "messages", **(media or {"images": "images"})}
    info["bad"] = {**info["shapes"], "file_name": "bad.json", "columns": columns}
    (data / "dataset_info.json").write_text(json.dumps(info))
    return data


def _build(tmp_path: Path, data_dir: Path, name: str, **settings) -> object:
    data = DataArguments(dataset=[name], dataset_dir=str(data_dir), template=settings.pop("template", "qwen2_vl"),
                         preprocessing_cache_dir=str(tmp_path / "cache"), **settings)
    run = DataRun(stage="sft", seed=0, seq_length=data.seq_length or data.cutoff_len, global_batch_size=1,
                  tokenizer_path=str(DEMO_VL))
    return build_datasets(data, run)


def _record(content: str, images: list[str], answer: str = "red") -> dict:
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}],
            "images": images}


GOOD = "images/red_square_56x56.png"


@pytest.mark.parametrize(("records", "message"), [
    ([_record("<image>colour?", [GOOD]), _record("<image>colour?", ["images/nope.png"])],
     r"bad.json:record 2: image 'images/nope.png' does not exist"),
    ([_record("<image>colour?", ["notes.png"])], r"bad.json:record 1: image '.*notes.png' cannot be read"),
    ([_record("<image><image>colour?", [GOOD])],
     r"bad.json:record 1: 2 <image> placeholder\(s\) in the turns but 1 image\(s\)"),
    ([_record("colour?", [GOOD])], r"bad.json:record 1: 0 <image> placeholder\(s\) in the turns but 1 image\(s\)"),
])
def test_bad_images_are_one_line_naming_the_sample(records, message, tmp_path):
    data = _demo_copy(tmp_path, records)
    (data / "notes.png").write_text("not an image")
    with pytest.raises(DataError, match=message) as err:
        _build(tmp_path, data, "bad", cutoff_len=128)
    assert "\n" not in str(err.value)


def test_image_tokens_cut_by_cutoff_len_are_refused(tmp_path):
    data = _demo_copy(tmp_path, [_record("a long question first " * 2 + "<image>", ["images/red_square_84x56.png"])])
    with pytest.raises(DataError, match=r"bad.json:record 1: its 1 image\(s\) take 6 image tokens, \d of which fit "
                                        r"data.cutoff_len=60") as err:
        _build(tmp_path, data, "bad", cutoff_len=60)
    assert "\n" not in str(err.value)


def test_videos_and_text_templates_are_refused_in_one_line(tmp_path):
    data = _demo_copy(tmp_path, [_record("<image>colour?", [GOOD])], {"videos": "videos"})
    with pytest.raises(DataError, match=r"dataset 'bad': columns.videos: videos and audios are not supported"):
        _build(tmp_path, data, "bad", cutoff_len=128)
    data = _demo_copy(tmp_path / "t", [_record("<image>colour?", [GOOD])])
    with pytest.raises(DataError, match=r"record 1: the record has 1 image\(s\) but data.template='qwen' is text only"):
        _build(tmp_path, data, "bad", cutoff_len=128, template="qwen")


# --- rows and micro-batches --------------------------------------------------------------


def test_packed_batches_carry_their_samples_pixels_in_token_order(tmp_path):
    built = _build(tmp_path, DEMO_VL / "data", "shapes", cutoff_len=128, seq_length=256, sequence_packing=True)
    rows = built.train
    vision = rows.vision
    assert rows.samples.stats["images"] == 320 and rows.samples.stats["samples"] == 240
    for first in (0, 5):
        batch = collate_batch([rows[first], rows[first + 1]])
        paths, expected_ids = [], []
        for r in (first, first + 1):
            for sample in rows.rows[r]:
                paths += rows.samples.images(sample)[0]
        pixels, grids = image_inputs(vision.processor, paths, vision.settings, "test")
        assert torch.equal(batch.pixel_values, torch.from_numpy(pixels))
        assert torch.equal(batch.image_grid_thw, torch.from_numpy(grids))
        # the image tokens, read row-major, are the images' in that order
        counts = (grids.prod(axis=1) // 4).tolist()
        assert int((batch.input_ids == vision.image_token_id).sum()) == sum(counts)
        assert batch.mrope_position_ids.shape == (3, 2, 256)
        for b, r in enumerate((first, first + 1)):
            cu = rows[r]["cu_seqlens_padded"]
            for k, sample in enumerate(rows.rows[r]):
                ids, _ = rows.samples.sample(sample)
                start = int(cu[k])
                expected_ids.append(ids)
                want = rope_index(ids, rows.samples.images(sample)[1], vision.image_token_id, 2)
                assert np.array_equal(batch.mrope_position_ids[:, b, start:start + len(ids)].numpy(), want)
    with pytest.raises(DataError, match=r"vision-language batches are not split over context parallelism"):
        batch.cp_shard(2, 0)
    padded = PackedBatch.from_collated(collate_rows([rows[0]]))
    assert padded.pixel_values is not None and padded.image_grid_thw.shape[1] == 3


def test_unpacked_rows_and_text_only_samples_in_a_vl_run(tmp_path):
    records = [_record("no image", []), _record("<image>colour?", [GOOD])]
    data = _demo_copy(tmp_path, records)
    rows = _build(tmp_path, data, "bad", cutoff_len=128).train
    text, image = rows[0], rows[1]
    assert text["pixel_values"].shape == (0, 1176) and text["image_grid_thw"].shape == (0, 3)
    n = int((text["attention_mask"] > 0).sum())
    assert torch.equal(text["mrope_position_ids"][:, :n], torch.arange(n).expand(3, n))
    assert image["image_grid_thw"].tolist() == [[1, 4, 4]] and image["pixel_values"].shape == (16, 1176)
    batch = collate_batch([text, image])
    assert batch.pixel_values.shape == (16, 1176) and batch.mrope_position_ids.shape == (3, 2, 128)


def test_image_pixel_limits_and_media_dir_are_honoured(tmp_path):
    media = tmp_path / "media" / "images"
    media.mkdir(parents=True)
    shutil.copy(DEMO_VL / "data" / "images" / "red_square_84x56.png", media / "wide.png")
    data = _demo_copy(tmp_path, [_record("<image>colour?", ["images/wide.png"])])
    settings = {"cutoff_len": 128, "media_dir": str(tmp_path / "media")}
    assert _build(tmp_path, data, "bad", **settings).train[0]["image_grid_thw"].tolist() == [[1, 4, 6]]
    # 84×56 = 4704 pixels scaled to at most 3136 (68×45), then Qwen's processor rounds it to 56×56
    small = _build(tmp_path, data, "bad", image_max_pixels=3136, **settings).train[0]
    assert small["image_grid_thw"].tolist() == [[1, 4, 4]]
    # scaled up to at least 200×200 pixels: 244×163 → 252×168 rounded by the processor
    large = _build(tmp_path, data, "bad", image_min_pixels=40000, **settings).train[0]
    assert large["image_grid_thw"].tolist() == [[1, 12, 18]]
