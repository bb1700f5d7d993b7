"""``lightning_vlmbalance.hf.lengths``: ``header_lengths`` equals ``item_lengths`` over
``ChatRecords`` on every tiny family (image sizes that resize, tile, crop, extreme aspect ratios;
0-3 images; single- and multi-turn), image sizes from headers, and length tables: reused without
the processor, refused by name when stale."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

pytest.importorskip("transformers")

import transformers as tf
from PIL import Image

from lightning_vlmbalance.hf import item_lengths
from lightning_vlmbalance.hf import lengths as L
from lightning_vlmbalance.hf.offline import image_size_from_header, tiny_processor
from lightning_vlmbalance.hf.records import ChatRecords
from lightning_vlmbalance.hf.synthetic import TINY_FAMILIES, tiny_config

# (height, width): below, at and above the tiny processors' sizes (16-64 px), extreme ratios
SIZES = (
    (20, 33),
    (40, 24),
    (7, 90),
    (90, 7),
    (64, 64),
    (16, 16),
    (100, 37),
    (3, 3),
    (33, 200),
    (150, 149),
    (15, 47),
    (2, 60),
)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("lengths")
    rng = np.random.default_rng(0)
    for h, w in SIZES:
        pixels = (rng.random((h, w, 3)) * 255).astype(np.uint8)
        Image.fromarray(pixels).save(root / f"{h}x{w}.png")
    return root


def make_records(n: int, seed: int, sizes: tuple = SIZES) -> list[dict]:
    """Records of 0-3 images (relative paths), images before, between and after text, adjacent
    images, and second user turns."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = i % 4
        names = [f"{h}x{w}.png" for h, w in (sizes[int(j)] for j in rng.integers(0, len(sizes), k))]
        text = {"type": "text", "text": "what is in it? " * int(rng.integers(1, 3))}
        if k >= 2 and i % 3 == 0:  # an image, text, then the others adjacent
            content = [{"type": "image"}, text, *[{"type": "image"}] * (k - 1)]
        else:
            content = [*[{"type": "image"}] * k, text]
        messages = [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": "a cat."}]},
        ]
        if i % 2:
            messages += [
                {"role": "user", "content": "and the colour?"},
                {"role": "assistant", "content": "grey."},
            ]
        out.append({"images": names, "messages": messages})
    return out


def assert_same(a, b):
    for name, x, y in zip(("total_tokens", "image_tokens", "images"), a, b):
        np.testing.assert_array_equal(x, y, err_msg=name)
        assert x.dtype == np.int64 == y.dtype


# -- 1. equal to item_lengths ----------------------------------------------------------------


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_header_lengths_equal_item_lengths(family, images, monkeypatch):
    config = tiny_config(family)
    proc = tiny_processor(family, config)
    # Mistral 3 refuses images of one feature (3 x 3 pixels become one 8 x 8 cell): see below
    sizes = tuple(s for s in SIZES if s != (3, 3)) if family == "mistral3" else SIZES
    records = make_records(12, seed=TINY_FAMILIES.index(family), sizes=sizes)
    data = ChatRecords(records, proc, root=images)
    reference = item_lengths(data, config)
    assert reference.images.sum() > 0

    def refuse(*args, **kwargs):
        raise AssertionError("the image processor ran")

    monkeypatch.setattr(type(proc.image_processor), "preprocess", refuse)
    monkeypatch.setattr(type(proc), "__call__", refuse)
    assert_same(L.header_lengths(data, config=config), reference)
    assert_same(L.header_lengths(data), reference)  # the family read from the processor


def test_a_record_item_lengths_refuses_is_refused_alike(images):
    """The family's own refusals apply (here Mistral 3's one-feature image), with its message."""
    config = tiny_config("mistral3")
    records = make_records(2, seed=0)
    records[1] = {**records[1], "images": ["3x3.png"]}
    data = ChatRecords(records, tiny_processor("mistral3", config), root=images)
    with pytest.raises(ValueError, match="sample 1: image 0 is 8x8 pixels") as ref:
        item_lengths(data, config)
    with pytest.raises(ValueError, match="sample 1: image 0 is 8x8 pixels") as got:
        L.header_lengths(data, config=config)
    assert str(got.value) == str(ref.value)


def test_settings_variants_equal_item_lengths(images, caplog):
    """Gemma 3 pan-and-scan (crops from the image processor's own rule), Idefics3 with a size
    that is not a multiple of its tile, and Pixtral with a center crop (a setting the size rules
    leave to the processor on blank images: counted exactly, logged)."""
    records = make_records(12, seed=99, sizes=tuple(s for s in SIZES if s != (3, 3)))
    gemma = tiny_processor("gemma3")
    gemma.images_kwargs = {  # on the instance: the class default turns pan-and-scan off
        **type(gemma).images_kwargs,
        "do_pan_and_scan": True,
        "pan_and_scan_min_crop_size": 4,
        "pan_and_scan_min_ratio_to_activate": 1.2,
    }
    idefics = tiny_processor(
        "idefics3",
        image_processor=tf.Idefics3ImageProcessorPil(
            size={"longest_edge": 40}, max_image_size={"longest_edge": 16}
        ),
    )
    pixtral = tiny_processor(
        "mistral3",
        image_processor=tf.PixtralImageProcessorPil(
            size={"longest_edge": 32},
            patch_size={"height": 8, "width": 8},
            do_center_crop=True,
            crop_size={"height": 16, "width": 16},
        ),
    )
    for family, proc in (("gemma3", gemma), ("idefics3", idefics), ("mistral3", pixtral)):
        config = tiny_config(family)
        data = ChatRecords(records, proc, root=images)
        reference = item_lengths(data, config)
        with caplog.at_level(logging.INFO, logger=L.__name__):
            got = L.header_lengths(data, config=config)
        assert_same(got, reference)
    assert reference.image_tokens.sum() > 0
    crops = L._plan_for(gemma, None).rules.image_inputs([(20, 90)])[0]["num_crops"]
    assert crops[0] > 0
    assert "counted by the processor on blank images" in caplog.text
    assert "PixtralImageProcessorPil" in caplog.text


def test_missing_image_and_bad_records_are_named(images):
    proc = tiny_processor("qwen2_5_vl")
    records = make_records(3, seed=1)
    records[1] = {**records[1], "images": ["nope.png"]}
    with pytest.raises(ValueError, match=r"record 1: image file .*nope\.png does not exist"):
        L.header_lengths(ChatRecords(records, proc, root=images))
    records = make_records(3, seed=1)
    records[2] = {**records[2], "images": records[2]["images"][:1]}  # 2 image entries, 1 image
    with pytest.raises(ValueError, match="record 2: 2 image entries in its messages, 1 images"):
        L.header_lengths(ChatRecords(records, proc, root=images))
    records = make_records(3, seed=1)
    records[0] = {**records[0], "messages": records[0]["messages"][:1]}
    with pytest.raises(ValueError, match="record 0: no assistant message"):
        L.header_lengths(ChatRecords(records, proc, root=images))


# -- 2. image sizes from headers -------------------------------------------------------------


def test_image_size_reads_headers_with_exif_orientation(tmp_path):
    plain = tmp_path / "plain.png"
    Image.new("RGB", (30, 10)).save(plain)
    assert L.image_size(plain) == (10, 30)
    for suffix, fmt in ((".png", "PNG"), (".jpg", "JPEG")):
        rotated = tmp_path / f"rotated{suffix}"
        exif = Image.Exif()
        exif[0x0112] = 6  # rotate 90: the processor sees 30 x 10 upright
        Image.new("RGB", (30, 10)).save(rotated, format=fmt, exif=exif.tobytes())
        assert L.image_size(rotated) == (30, 10) == image_size_from_header(str(rotated))


# -- 3. length tables ------------------------------------------------------------------------


@pytest.fixture
def table_case(images, tmp_path):
    config = tiny_config("qwen2_5_vl")
    proc = tiny_processor("qwen2_5_vl", config)
    records = make_records(10, seed=5)
    path = tmp_path / "lengths.npz"
    lengths = L.header_lengths(ChatRecords(records, proc, root=images), table=path)
    assert path.exists()
    return config, proc, records, path, lengths


def test_saved_table_is_reused_without_the_processor(table_case, images, monkeypatch):
    config, proc, records, path, lengths = table_case

    def refuse(*args, **kwargs):
        raise AssertionError("the processor ran")

    monkeypatch.setattr(type(proc), "__call__", refuse)
    monkeypatch.setattr(type(proc), "apply_chat_template", refuse)
    monkeypatch.setattr(type(proc.tokenizer), "__call__", refuse)
    data = ChatRecords(records, proc, root=images)
    assert_same(L.header_lengths(data, table=path), lengths)
    assert_same(L.load_length_table(path, data), lengths)
    monkeypatch.undo()
    assert_same(lengths, item_lengths(data, config))


def test_save_and_load_round_trip(table_case, images, tmp_path):
    _, proc, records, _, lengths = table_case
    data = ChatRecords(records, proc, root=images)
    other = tmp_path / "again.npz"
    L.save_length_table(other, lengths, L.length_fingerprint(data))
    assert_same(L.load_length_table(other, data), lengths)
    with np.load(other) as z:
        assert set(z.files) == {
            "total_tokens",
            "image_tokens",
            "images",
            "record_hashes",
            "file_hashes",
            "fingerprint",
        }


def test_stale_image_setting_is_refused_by_name(table_case, images):
    _, _, records, path, _ = table_case
    config = tiny_config("qwen2_5_vl")
    vc = config.vision_config
    changed = tiny_processor(
        "qwen2_5_vl",
        config,
        image_processor=tf.Qwen2VLImageProcessorPil(
            patch_size=vc.patch_size,
            merge_size=vc.spatial_merge_size,
            temporal_patch_size=vc.temporal_patch_size,
            size={"shortest_edge": 64, "longest_edge": 4096},
        ),
    )
    data = ChatRecords(records, changed, root=images)
    with pytest.raises(
        ValueError, match=r"image processor setting size\.longest_edge: saved 2304, now 4096"
    ):
        L.header_lengths(data, table=path)


def test_stale_tokenizer_template_and_records_are_refused_by_name(table_case, images):
    _, proc, records, path, _ = table_case
    proc.tokenizer.add_tokens(["<new>"])
    with pytest.raises(ValueError, match="tokenizer vocab changed"):
        L.load_length_table(path, ChatRecords(records, proc, root=images))

    fresh = tiny_processor("qwen2_5_vl")
    fresh.chat_template = fresh.chat_template.replace("':'", "': '")
    with pytest.raises(ValueError, match="chat template changed"):
        L.load_length_table(path, ChatRecords(records, fresh, root=images))

    fresh = tiny_processor("qwen2_5_vl")
    more = records + make_records(2, seed=6)
    with pytest.raises(ValueError, match="record count: saved 10, now 12"):
        L.load_length_table(path, ChatRecords(more, fresh, root=images))

    edited = [dict(r) for r in records]
    edited[3] = {**edited[3], "messages": [*edited[3]["messages"][:1], edited[3]["messages"][1]]}
    edited[3]["messages"][0] = {"role": "user", "content": "a different question"}
    edited[3]["images"] = []
    with pytest.raises(ValueError, match=r"records content changed for 1 records: 3"):
        L.load_length_table(path, ChatRecords(edited, fresh, root=images))

    first = next(i for i, r in enumerate(records) if r["images"])
    image = images / records[first]["images"][0]
    st = os.stat(image)
    os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        with pytest.raises(ValueError, match=rf"image files .* changed for \d+ records: {first}"):
            L.header_lengths(ChatRecords(records, fresh, root=images), table=path)
    finally:
        os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_not_a_table_is_refused(images, tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a table")
    data = ChatRecords(make_records(2, seed=0), tiny_processor("qwen2_vl"), root=images)
    with pytest.raises(ValueError, match="not a readable length table"):
        L.load_length_table(bad, data)
