"""The files of a dataset's image_dir: which are read as images and as captions (subfolders, hidden files, types
not read, animated images, captions without an image) and how (EXIF orientation, a PNG's size, a BOM)."""

import os
import re
import shutil
import warnings

import pytest
from PIL import Image

from library.data import dataset as D, image_folders
from library.data.dataset_config import parse_dataset_config
from tests.test_dataset import blueprint, make_image


def test_a_missing_image_dir_names_the_dataset_config_and_where_a_relative_path_is_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bp = parse_dataset_config({"datasets": [{"resolution": 32, "subsets": [{"image_dir": "data/cats"}]}]},
                              source="my_dataset.toml")
    with pytest.raises(ValueError) as e:  # was "data/cats: image_dir does not exist or is not a folder"
        image_folders.scan_images(bp)
    assert str(e.value) == (f"my_dataset.toml: data/cats: image_dir does not exist or is not a folder (a relative "
                            f"image_dir is read from the current folder, {tmp_path})")


def test_images_in_subfolders_of_image_dir_are_said_not_trained(tmp_path):
    """image_dir is read at its top only (as sd-scripts and musubi-tuner read it). The old line said
    nothing of the images below (a parent of sd-scripts' '10_name' folders trained on none of them
    and reported only 'holds no images'); the subset's reference and mask folders are not counted."""
    root = tmp_path / "train"
    for name in ("10_cats/a.png", "10_cats/b.png", "5_dogs/c.png", ".hidden/d.png"):
        make_image(root / name, 64, 64)
    with pytest.raises(ValueError, match=r"holds no images .*; its subfolders hold 3 \(e.g. 10_cats/a.png\), and "
                                         r"image_dir is not searched recursively: give each folder its own"):
        image_folders.scan_images(blueprint(root, class_tokens="x"))
    make_image(root / "top.png", 64, 64)
    make_image(root / "ctrl" / "top.png", 64, 64)
    make_image(root / "masks" / "top.png", 64, 64, (255, 255, 255))
    bp = parse_dataset_config({"datasets": [{"resolution": 64, "subsets": [
        {"image_dir": str(root), "class_tokens": "x", "control_directory": str(root / "ctrl"),
         "mask_dir": str(root / "masks")}]}]}, source="test.toml")
    said = r"train: 3 images are not trained: its subfolders hold 3 \(e.g. 10_cats/a.png\)"
    with pytest.warns(UserWarning, match=said):
        items = image_folders.scan_images(bp)
    assert [os.path.basename(i.image_path) for i in items] == ["top.png"]


def test_a_subfolder_another_subset_or_validation_set_reads_is_not_said_not_trained(tmp_path):
    """Subset 1 reads data, subset 2 (or a [[validation_datasets]] subset) data/closeups: the scan said
    closeups' image 'not trained' and told to give it a subset of its own (a held-out one would then be
    trained). A subfolder no subset reads is still said."""
    root = tmp_path / "data"
    for name in ("a.png", "closeups/c.png", "loose/x.png"):
        make_image(root / name, 64, 64)
    for section, sets in (("datasets", 2), ("validation_datasets", 1)):
        config = {"datasets": [{"resolution": 64, "subsets": [{"image_dir": str(root), "class_tokens": "x"}]}]}
        closeups = {"resolution": 64, "subsets": [{"image_dir": str(root / "closeups"), "class_tokens": "x"}]}
        config[section] = config.get(section, []) + [closeups]
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            items = image_folders.scan_images(parse_dataset_config(config, source="t.toml"))
        assert len(items) == sets
        assert [str(w.message).split(": its subfolders")[0] for w in said] == [f"{root}: 1 images are not trained"]
        assert "its subfolders hold 1 (e.g. loose/x.png)" in str(said[0].message)


def test_hidden_files_beside_the_images_are_not_images(tmp_path):
    """macOS leaves a '._name' resource fork beside every file it copies to a USB disk or a share; sd-scripts'
    glob skips them. The old scan verified '._a.png' as an image and stopped: 'cannot be read as an image'."""
    from library.data.check import check_dataset

    make_image(tmp_path / "img" / "a.png", 32, 32)
    make_image(tmp_path / "masks" / "a.png", 32, 32, (255, 255, 255))
    for folder in ("img", "masks"):
        (tmp_path / folder / "._a.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    bp = parse_dataset_config({"datasets": [{"resolution": 32, "subsets": [
        {"image_dir": str(tmp_path / "img"), "class_tokens": "x", "mask_dir": str(tmp_path / "masks")}]}]},
        source="t.toml")
    (item,) = D.ImageDataset(bp).items
    assert (os.path.basename(item.image_path), os.path.basename(item.mask_path)) == ("a.png", "a.png")
    report = check_dataset(bp)
    assert report.problems() == [] and report.subsets[0].images == 1


def test_an_exif_rotated_jpeg_trains_as_displayed_with_its_bucket_and_mask(tmp_path):
    """Phones store portrait photos landscape with an EXIF orientation; sd-scripts' loader ignores it
    (the photo trains on its side). Here size, bucket, pixels and the mask all follow the display."""
    img = Image.new("RGB", (64, 32), (0, 0, 0))
    img.paste((255, 255, 255), (0, 0, 32, 32))  # stored: left half white
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed rotated 90 degrees clockwise: top half white
    os.makedirs(tmp_path / "img")
    img.save(tmp_path / "img" / "a.jpg", exif=exif.tobytes(), quality=95)
    make_image(tmp_path / "masks" / "a.png", 32, 64, (255, 255, 255))
    bp = parse_dataset_config({"datasets": [{"resolution": [32, 64], "subsets": [
        {"image_dir": str(tmp_path / "img"), "class_tokens": "x", "mask_dir": str(tmp_path / "masks")}]}]},
        source="t.toml")
    ds = D.ImageDataset(bp)
    assert (ds.items[0].size, ds.items[0].bucket) == ((32, 64), (32, 64))
    sample = ds[0]
    assert sample["image"].shape == (3, 64, 32) and sample["mask"].shape == (1, 8, 4)
    assert float(sample["image"][:, :28].mean()) > 0.95 and float(sample["image"][:, 36:].mean()) < -0.95


def test_a_png_size_is_read_without_decoding_its_pixels_unless_its_exif_follows_them(tmp_path, monkeypatch):
    """Pillow's getexif decodes a whole PNG that has no EXIF before its pixels (it may follow them):
    the size check decoded every PNG of a dataset (1 decode each, 40 ms at 1024 px, 20x the rest).
    Now only a PNG whose eXIf / text chunk follows its IDAT is decoded; each keeps its orientation."""
    import struct
    import zlib

    from PIL import ImageFile

    from library.data.images import verified_image_size

    exif = Image.Exif()
    exif[0x0112] = 6  # displayed rotated 90 degrees: 20 x 40 for a stored 40 x 20
    Image.new("RGB", (40, 20)).save(tmp_path / "plain.png")
    Image.new("RGB", (40, 20)).save(tmp_path / "before.png", exif=exif)
    data, chunk = (tmp_path / "plain.png").read_bytes(), exif.tobytes()
    end = data.rindex(b"IEND") - 4
    late = struct.pack(">I", len(chunk)) + b"eXIf" + chunk + struct.pack(">I", zlib.crc32(b"eXIf" + chunk))
    (tmp_path / "after.png").write_bytes(data[:end] + late + data[end:])
    decodes = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load",
                        lambda self: (decodes.append(os.path.basename(self.filename)) if self.tile else None,
                                      real_load(self))[1])
    sizes = [verified_image_size(str(tmp_path / f"{name}.png")) for name in ("plain", "before", "after")]
    assert sizes == [(40, 20), (20, 40), (20, 40)] and decodes == ["after.png"]


def test_images_of_a_type_not_read_are_said_not_skipped_silently(tmp_path):
    """A phone's HEIC photos beside its JPEGs: the old scan trained the JPEGs alone without a word."""
    make_image(tmp_path / "img" / "a.jpg", 32, 32)
    for name in ("b.HEIC", "c.heic", "d.tif"):
        (tmp_path / "img" / name).write_bytes(b"not read")
    bp = blueprint(tmp_path / "img", class_tokens="x", resolution=32)
    with pytest.warns(UserWarning) as caught:
        assert len(D.ImageDataset(bp).items) == 1
    assert [str(w.message) for w in caught] == [
        f"{tmp_path / 'img'}: 3 files of a type not read (.heic, .tif; e.g. b.HEIC) are not trained: convert them to "
        f".png, .jpg, .jpeg, .webp, .bmp, .avif"]
    os.remove(tmp_path / "img" / "a.jpg")
    said = "image_dir holds no images (.png, .jpg, .jpeg, .webp, .bmp, .avif); 3 files"
    with pytest.raises(ValueError, match=re.escape(said)):
        D.ImageDataset(bp)


def test_avif_images_are_trained_as_the_peers_read_them(tmp_path):
    """musubi-tuner reads .avif (sd-scripts with pillow-avif-plugin), and the pinned Pillow decodes it: a folder of
    AVIF photos stopped with "image_dir holds no images", a mixed one trained without them."""
    from library.data.images import load_rgb

    (tmp_path / "img").mkdir()
    Image.new("RGB", (48, 32), (200, 40, 40)).save(tmp_path / "img" / "a.avif")
    (tmp_path / "img" / "a.txt").write_text("a red photo")
    (item,) = D.ImageDataset(blueprint(tmp_path / "img", resolution=32)).items
    assert item.image_path.endswith("a.avif") and item.size == (48, 32) and item.caption == "a red photo"
    red, green, _ = load_rgb(item.image_path).getpixel((24, 16))
    assert red > 150 and green < 100  # decoded, not a stand-in


def test_an_animated_webp_or_apng_is_refused_naming_the_file_not_trained_on_its_first_frame(tmp_path):
    """Pillow reads an animated WebP's or APNG's first frame alone: it trained on that without a word, where a
    GIF is said not read. Now the scan, the check and a direct read stop on one line naming the file."""
    from library.data.check import check_dataset
    from library.data.images import load_rgb

    make_image(tmp_path / "img" / "a.jpg", 32, 32)
    frames = [Image.new("RGB", (32, 32), (80 * i, 0, 0)) for i in range(3)]
    for name in ("b.webp", "c.png"):
        frames[0].save(tmp_path / "img" / name, save_all=True, append_images=frames[1:])
        shutil.copy(tmp_path / "img" / name, tmp_path / "one")  # alone in its folder: that file is named
        said = f"{tmp_path / 'one'}: an animated image (3 frames): only its first frame would be read"
        with pytest.raises(ValueError, match=re.escape(said)):
            load_rgb(str(tmp_path / "one"))
    bp = blueprint(tmp_path / "img", class_tokens="x", resolution=32)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'img' / 'b.webp'}: an animated image (3 frames)")):
        D.ImageDataset(bp)
    errors = [p.message for p in check_dataset(bp).problems() if p.severity == "error"]
    named = [str(tmp_path / "img" / name) for name in ("b.webp", "c.png")]
    assert [e.split(": an animated image")[0] for e in errors] == named


def test_a_jpeg_of_several_pictures_is_a_photo_read_as_its_first(tmp_path):
    """A phone's Ultra HDR photo (a gain map after the picture: MPO, n_frames 2, named .jpg) was refused as "an
    animated image (2 frames)" by the animation check: it is one photo, read as its first picture."""
    from library.data.images import load_rgb, verified_image_size

    pictures = [Image.new("RGB", (40, 32), (200, 30, 30)), Image.new("RGB", (40, 32), (0, 0, 0))]
    pictures[0].save(tmp_path / "photo.jpg", format="MPO", save_all=True, append_images=pictures[1:])
    with Image.open(tmp_path / "photo.jpg") as img:
        assert img.format == "MPO" and img.n_frames == 2
    assert verified_image_size(str(tmp_path / "photo.jpg")) == (40, 32)
    assert load_rgb(str(tmp_path / "photo.jpg")).getpixel((20, 16))[0] > 150  # the first picture, red


def test_caption_files_without_an_image_of_their_name_are_said(tmp_path):
    """A dataset moved from Windows: Photo.JPG's caption photo.txt paired there, not here, and Photo.JPG
    trained on class_tokens without a word; a caption left by a deleted image was passed over silently too."""
    make_image(tmp_path / "img" / "Photo.JPG", 32, 32)
    make_image(tmp_path / "img" / "b.png", 32, 32)
    (tmp_path / "img" / "c.heic").write_bytes(b"not read")  # not read: said by its own line, its caption not again
    make_image(tmp_path / "img" / "k.png", 32, 32)  # its caption k.TXT: the extension in another case (not said before)
    for name in ("photo.txt", "b.txt", "c.txt", "gone.txt", "notes.caption", ".hidden.txt", "k.TXT"):
        (tmp_path / "img" / name).write_text("a caption")
    bp = blueprint(tmp_path / "img", class_tokens="x", resolution=32)
    with pytest.warns(UserWarning) as caught:
        assert len(D.ImageDataset(bp).items) == 3
    said = [str(w.message) for w in caught if "caption files" in str(w.message)]
    assert said == [f"{tmp_path / 'img'}: 3 .txt caption files have no image of their name (e.g. gone.txt); k.TXT "
                    "is not read as k.png's caption (file names are case-sensitive here; it reads k.txt): rename it"]
    from library.data.check import check_dataset
    assert [p.message for p in check_dataset(bp).problems() if "caption files" in p.message] == said
    expected = ("Photo.JPG: no caption file 'Photo.txt' and no class_tokens for its subset; 'photo.txt' is beside it, "
                "and file names are case-sensitive")
    with pytest.raises(ValueError, match=re.escape(expected)):
        D.ImageDataset(blueprint(tmp_path / "img", resolution=32))  # without class_tokens: the error names it too


def test_a_caption_saved_by_notepad_with_a_bom_and_crlf_reads_as_its_text(tmp_path):
    make_image(tmp_path / "img" / "a.png", 32, 32)
    (tmp_path / "img" / "a.txt").write_bytes("\ufeffa red square, photo\r\n".encode("utf-8"))
    make_image(tmp_path / "img" / "b.png", 32, 32, (1, 2, 3))
    (tmp_path / "img" / "b.txt").write_bytes("\ufeffohwx ||| red, square\r\n".encode("utf-8"))
    bp = parse_dataset_config({"datasets": [{"resolution": 32, "subsets": [
        {"image_dir": str(tmp_path / "img"), "keep_tokens_separator": "|||"}]}]}, source="t.toml")
    ds = D.ImageDataset(bp)
    assert [ds[e]["caption"] for e in range(2)] == ["a red square, photo", "ohwx, red, square"]
