"""Image-text retrieval: the batched pipeline against brute force (one image / one text / one pair at a time),
the chance level against exhaustive enumeration, and ``mplug eval retrieval`` on a Karpathy file."""
import itertools
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

import mplug_pretrain  # noqa: F401  (torchvision shim first)
from mplug_pretrain.config import config_from_dict
from mplug_pretrain.data.tokenizer import load_tokenizer, tokenize
from mplug_pretrain.metrics.retrieval_recall import retrieval_recall
from mplug_pretrain.metrics.retrieval_scoring import (
    chance_recall,
    embed_images,
    embed_texts,
    evaluate_retrieval,
    score_matrices,
)
from mplug_pretrain.models.presets import build_model
from mplug_pretrain.tasks.retrieval import evaluate as retrieval_task

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = ["a", "red", "blue", "green", "circle", "square", "triangle", "small", "large", "on", "the", "left",
         "right", "top", "bottom", "of", "and"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model("tiny").eval()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def small_set(tokenizer):
    """6 random images, 2 or 3 captions each of different lengths (so batches carry padding)."""
    g = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(1)
    images = torch.randn(6, 3, 64, 64, generator=g)
    captions = [[" ".join(rng.choice(WORDS, size=rng.integers(2, 9))) for _ in range(2 + i % 2)]
                for i in range(6)]
    texts = [c for per_image in captions for c in per_image]
    text_to_image = [i for i, per_image in enumerate(captions) for _ in per_image]
    return images, texts, text_to_image


@torch.no_grad()
def one_by_one(model, tokenizer, images, texts):
    """Independent computation: every image and every text encoded alone (no batch, no padding)."""
    image_states = [model.encode_image(img[None]) for img in images]
    text_inputs = [tokenize(tokenizer, [t], 35) for t in texts]
    text_states = [model.encode_text(ids, mask) for ids, mask in text_inputs]
    f_v = torch.cat([model.itc.image_features(s[:, 0]) for s in image_states])
    f_l = torch.cat([model.itc.text_features(s[:, 0]) for s in text_states])
    itm = torch.empty(len(images), len(texts))
    for i, j in itertools.product(range(len(images)), range(len(texts))):
        _, fused = model.fuse(image_states[i], None, text_states[j], text_inputs[j][1])
        itm[i, j] = model.itm_head(fused[:, 0])[0, 1]
    return (f_v @ f_l.t()).double().numpy(), itm.double().numpy()


@pytest.fixture(scope="module")
def brute_force(model, tokenizer, small_set):
    images, texts, _ = small_set
    return one_by_one(model, tokenizer, images, texts)


@pytest.fixture(scope="module")
def banks(model, tokenizer, small_set):
    images, texts, _ = small_set
    ids, mask = tokenize(tokenizer, texts, 35)
    return embed_images(model, [images[:4], images[4:]]), embed_texts(model, ids, mask, batch_size=5)


def test_itc_only_equals_the_direct_matrix(model, small_set, brute_force, banks):
    _, _, text_to_image = small_set
    itc_direct, _ = brute_force
    itc, i2t, t2i = score_matrices(model, *banks, k=3, score="itc")
    np.testing.assert_allclose(itc, itc_direct, atol=1e-5)
    assert i2t is itc and t2i is itc
    metrics = evaluate_retrieval(model, *banks, text_to_image, k=3, score="itc")
    expected = retrieval_recall(itc_direct, text_to_image)
    assert {k: metrics[k] for k in expected} == pytest.approx(expected)
    assert metrics["itc"] == pytest.approx(expected)


@pytest.mark.parametrize("score", ["itm", "itm+itc"])
@pytest.mark.parametrize("k", [2, 50])
def test_rerank_equals_the_per_pair_itm_loop(model, small_set, brute_force, banks, score, k):
    _, _, text_to_image = small_set
    itc_direct, itm_direct = brute_force
    n_img, n_txt = itc_direct.shape
    final = itm_direct + itc_direct if score == "itm+itc" else itm_direct
    expected_i2t = np.full((n_img, n_txt), -np.inf)
    expected_t2i = np.full((n_img, n_txt), -np.inf)
    for i in range(n_img):  # each image's k most ITC-similar texts, re-scored
        top = sorted(range(n_txt), key=lambda j: -itc_direct[i, j])[:k]
        expected_i2t[i, top] = final[i, top]
    for j in range(n_txt):
        top = sorted(range(n_img), key=lambda i: -itc_direct[i, j])[:k]
        expected_t2i[top, j] = final[top, j]
    _, i2t, t2i = score_matrices(model, *banks, k=k, score=score, batch_size=4)
    np.testing.assert_allclose(i2t, expected_i2t, atol=1e-4)
    np.testing.assert_allclose(t2i, expected_t2i, atol=1e-4)
    metrics = evaluate_retrieval(model, *banks, text_to_image, k=k, score=score, batch_size=7)
    expected = retrieval_recall(expected_i2t, text_to_image, expected_t2i)
    assert {key: metrics[key] for key in expected} == pytest.approx(expected)
    assert metrics["rerank_score"] == score and metrics["k_test"] == k


def test_chance_recall_equals_the_mean_over_all_rankings():
    text_to_image = [0, 0, 1, 2, 2, 2]  # 3 images with 2, 1, 3 texts
    ks = (1, 2, 5)
    hits = {f"txt_r{k}": [] for k in ks} | {f"img_r{k}": [] for k in ks}
    for image in range(3):  # every ordering of the 6 texts for each image
        for order in itertools.permutations(range(6)):
            best = min(order.index(j) for j in range(6) if text_to_image[j] == image)
            for k in ks:
                hits[f"txt_r{k}"].append(best < k)
    for text in range(6):  # every ordering of the 3 images for each text
        for order in itertools.permutations(range(3)):
            for k in ks:
                hits[f"img_r{k}"].append(order.index(text_to_image[text]) < k)
    expected = {key: 100.0 * float(np.mean(v)) for key, v in hits.items()}
    assert chance_recall(text_to_image, ks) == pytest.approx(expected)


def test_eval_retrieval_on_a_karpathy_file_skips_a_corrupt_image(tmp_path, model):
    """``mplug eval retrieval``'s task on dataset_coco.json-style input, one image file broken."""
    model_dir = str(tmp_path / "model")
    model.save_pretrained(model_dir)
    rng = np.random.default_rng(2)
    folder = tmp_path / "images" / "val2014"
    os.makedirs(folder)
    entries = []
    for i in range(5):
        name = f"COCO_val2014_{i:012d}.jpg"
        Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(folder / name)
        entries.append({"cocoid": i, "filepath": "val2014", "filename": name,
                        "split": "test" if i < 4 else "train",
                        "sentences": [{"raw": " ".join(rng.choice(WORDS, 5))} for _ in range(2)]})
    (folder / entries[1]["filename"]).write_bytes(b"not a jpeg")
    with open(tmp_path / "dataset_coco.json", "w") as f:
        json.dump({"images": entries}, f)
    cfg = config_from_dict({"eval": {"annotations": str(tmp_path / "dataset_coco.json"),
                                     "image_root": str(tmp_path / "images"), "split": "test", "k_test": 3,
                                     "num_workers": 0, "batch_size": 2}})
    out = tmp_path / "metrics.json"
    metrics = retrieval_task.run(cfg, model_dir, out=str(out))
    assert json.loads(out.read_text()) == json.loads(json.dumps(metrics))
    assert metrics["num_images"] == 3 and metrics["num_texts"] == 6  # 4 test images, 1 unreadable
    assert metrics["images_skipped"] == 1 and metrics["skip_reasons"] == {"corrupt_image": 1}
    assert entries[1]["filename"] in metrics["skipped_examples"][0]
    assert set(metrics) >= {"txt_r1", "txt_r5", "txt_r10", "img_r1", "img_r5", "img_r10", "r_mean", "itc",
                            "chance"}
