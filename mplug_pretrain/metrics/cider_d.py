"""CIDEr-D (Vedantam et al. 2015), numerically equal to pycocoevalcap's ``CiderScorer`` and fast
enough to be the SCST reward (ExpansionNet v2 eq. 14).

Inputs are already tokenized captions: a ``str`` is split on whitespace (as pycocoevalcap does),
any other sequence (list, 1-D array or tensor) is used as its tokens (words or token ids). For hypothesis h scored against
the m references r of its image, with n-gram orders k = 1..n (n=4):

    idf(g)     = log(D) - log(max(1, df(g)))         D documents, df(g) documents containing g
    v_k(s)[g]  = tf_s(g) * idf(g)                    for the order-k n-grams g of caption s
    sim_k(h,r) = sum_g min(v_k(h)[g], v_k(r)[g]) * v_k(r)[g] / (|v_k(h)| |v_k(r)|)   (clipped)
               * exp(-(l_h - l_r)^2 / (2 sigma^2))   (sigma = 6)
    CIDEr-D(h) = 10 / m * sum_r mean_k sim_k(h, r)

Two details copied from pycocoevalcap so that results are equal to 1e-9 and more:
- the length l_s is the number of *bigrams* of s (max(len - 1, 0); 0 when n = 1), not its word
  count; the Gaussian penalty therefore only sees the difference of word counts for captions of
  2+ words;
- a document is one scored (hypothesis, references) entry: with k hypotheses per image the
  image's references count k times in df and D is the number of hypotheses.
(pycocoevalcap itself only works with n = 4: its ``cook_refs`` ignores the scorer's n.)

Document frequency modes of :meth:`CiderD.score`:
- ``"fixed"`` (SCST): df from the corpus given to the constructor, one document per image,
  computed once (the training references);
- ``"corpus"`` (evaluation): df from the entries being scored, exactly what pycocoevalcap does.

EOS handling (SacreEOS, Hu et al.): ``eos_mode="standard"`` appends ``eos_token`` to every
reference and to every hypothesis (except those marked ``truncated``: sampled to the maximum
length without producing EOS), the configuration of ExpansionNet v2's signature
``STANDARD_wInit+Cider-D[n4,s6.0]+average[nspi5]``. ``"none"`` scores the captions as given.

Speed: reference n-grams are counted once at construction and kept as integer ids (CSR rows);
a call maps the hypotheses' n-grams to those ids with a few vectorised ``np.unique`` /
``np.searchsorted`` passes and computes every (hypothesis, reference) similarity at once.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal

import numpy as np

Caption = str | Sequence[Hashable]
EosMode = Literal["none", "standard"]
DfMode = Literal["fixed", "corpus"]


def _tokens(caption: Caption, what: str) -> list:
    if isinstance(caption, str):
        return caption.split()
    if hasattr(caption, "tolist"):  # a 1-D numpy array or torch tensor of token ids
        caption = caption.tolist()
    if isinstance(caption, Sequence):
        return list(caption)
    raise TypeError(f"{what}: expected a str or a sequence of tokens, got {type(caption).__name__}")


def _concat_ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, e)`` for each pair, vectorised."""
    lengths = stops - starts
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    # offset of each output element inside its own range
    run_start = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + (np.arange(total, dtype=np.int64) - run_start)


class _Sentences:
    """A batch of token-id sentences flattened: per position its token, sentence and how many
    tokens remain in the sentence from there (so order-k n-grams start where remaining >= k)."""

    def __init__(self, token_ids: list[list[int]]):
        lengths = np.array([len(t) for t in token_ids], dtype=np.int64)
        self.lengths = lengths
        self.tokens = np.fromiter((i for t in token_ids for i in t), dtype=np.int64, count=int(lengths.sum()))
        self.sentence = np.repeat(np.arange(len(token_ids), dtype=np.int64), lengths)
        ends = np.cumsum(lengths)
        self.remaining = np.repeat(ends, lengths) - np.arange(len(self.tokens), dtype=np.int64)


class CiderD:
    """CIDEr-D scorer with reference n-grams precomputed per image.

    Args:
        refs: the reference corpus, ``refs[i]`` = the (>= 1) reference captions of image i.
        n: largest n-gram order. sigma: the Gaussian length-penalty width.
        eos_mode: ``"none"`` or ``"standard"`` (append ``eos_token`` to refs and hypotheses).
    """

    def __init__(self, refs: Sequence[Sequence[Caption]], n: int = 4, sigma: float = 6.0,
                 eos_mode: EosMode = "none", eos_token: Hashable = "<eos>"):
        if n < 1:
            raise ValueError(f"n: must be >= 1, got {n}")
        if sigma <= 0:
            raise ValueError(f"sigma: must be > 0, got {sigma}")
        if eos_mode not in ("none", "standard"):
            raise ValueError(f"eos_mode: expected 'none' or 'standard', got {eos_mode!r}")
        if isinstance(eos_token, str) and (not eos_token or eos_token != eos_token.strip() or " " in eos_token):
            raise ValueError(f"eos_token: must be one non-empty whitespace-free token, got {eos_token!r}")
        if len(refs) == 0:
            raise ValueError("refs: the reference corpus is empty")
        self.n, self.sigma, self.eos_mode, self.eos_token = n, float(sigma), eos_mode, eos_token

        word_ids: dict[Hashable, int] = {}
        sentences: list[list[int]] = []
        refs_per_image = np.empty(len(refs), dtype=np.int64)
        for i, image_refs in enumerate(refs):
            if isinstance(image_refs, str) or len(image_refs) == 0:
                raise ValueError(f"refs[{i}]: expected a non-empty list of reference captions")
            refs_per_image[i] = len(image_refs)
            for j, ref in enumerate(image_refs):
                toks = _tokens(ref, f"refs[{i}][{j}]")
                if eos_mode == "standard":
                    toks.append(eos_token)
                sentences.append([word_ids.setdefault(t, len(word_ids)) for t in toks])
        self._word_ids = word_ids
        self.num_images = len(refs)
        self._image_ref_ptr = np.concatenate([[0], np.cumsum(refs_per_image)])
        sent = _Sentences(sentences)
        vocab = max(len(word_ids), 1)

        # global n-gram ids: order 1 = word ids; order k = offset_k + rank of the key
        # (id of the (k-1)-gram prefix) * vocab + last word, among the corpus' order-k keys
        self._keys: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
        self._offsets = [0, vocab]
        gram = sent.tokens.copy()
        rows, grams = [sent.sentence], [gram]
        for k in range(2, n + 1):
            valid = np.flatnonzero(sent.remaining >= k)
            key = gram[valid] * vocab + sent.tokens[valid + k - 1]
            keys, inverse = np.unique(key, return_inverse=True)
            gram = np.full(len(sent.tokens), -1, dtype=np.int64)
            gram[valid] = self._offsets[-1] + inverse
            self._keys.append(keys)
            self._offsets.append(self._offsets[-1] + len(keys))
            rows.append(sent.sentence[valid])
            grams.append(gram[valid])
        self._vocab = vocab
        self._num_grams = self._offsets[-1]
        row, gram_all = np.concatenate(rows), np.concatenate(grams)

        # per reference: sorted (n-gram id, term frequency) as CSR rows
        entry, tf = np.unique(row * self._num_grams + gram_all, return_counts=True)
        self._ref_gram = entry % self._num_grams
        self._ref_tf = tf.astype(np.float64)
        self._ref_ptr = np.searchsorted(entry // self._num_grams, np.arange(len(sentences) + 1))
        self._ref_length = self._bigram_count(sent.lengths)
        self._ref_image = np.repeat(np.arange(self.num_images, dtype=np.int64), refs_per_image)

        # fixed document frequency: one document per image
        image_gram = np.unique(self._ref_image[entry // self._num_grams] * self._num_grams + self._ref_gram)
        self._df = np.bincount(image_gram % self._num_grams, minlength=self._num_grams).astype(np.float64)

    def _bigram_count(self, lengths: np.ndarray) -> np.ndarray:
        # pycocoevalcap's "length" is the count of 2-grams (its `if n == 1` on 0-based orders)
        if self.n < 2:
            return np.zeros(len(lengths), dtype=np.float64)
        return np.maximum(lengths - 1, 0).astype(np.float64)

    def score(self, hyps: Sequence[Caption], image_index: Sequence[int] | np.ndarray,
              df: DfMode = "fixed", truncated: Sequence[bool] | np.ndarray | None = None) -> np.ndarray:
        """CIDEr-D of each hypothesis against the references of ``image_index[i]``.

        Returns float64 [len(hyps)]. Several hypotheses may share an image (SCST's k samples).
        ``truncated[i]`` = True leaves hypothesis i without EOS in ``eos_mode="standard"``.
        """
        image_index = np.asarray(image_index, dtype=np.int64).reshape(-1)
        num_hyps = len(hyps)
        if len(image_index) != num_hyps:
            raise ValueError(f"image_index: {len(image_index)} entries for {num_hyps} hypotheses")
        if num_hyps == 0:
            return np.zeros(0, dtype=np.float64)
        if image_index.min() < 0 or image_index.max() >= self.num_images:
            bad = int(image_index[(image_index < 0) | (image_index >= self.num_images)][0])
            raise ValueError(f"image_index: {bad} is outside the corpus of {self.num_images} images")
        if df not in ("fixed", "corpus"):
            raise ValueError(f"df: expected 'fixed' or 'corpus', got {df!r}")
        if truncated is not None and len(truncated) != num_hyps:
            raise ValueError(f"truncated: {len(truncated)} flags for {num_hyps} hypotheses")
        n, vocab, num_grams = self.n, self._vocab, self._num_grams

        # hypotheses -> token ids; words unseen in the references get ids >= vocab
        oov: dict[Hashable, int] = {}
        sentences = []
        for i, hyp in enumerate(hyps):
            toks = _tokens(hyp, f"hyps[{i}]")
            if self.eos_mode == "standard" and not (truncated is not None and truncated[i]):
                toks.append(self.eos_token)
            ids = []
            for t in toks:
                wid = self._word_ids.get(t)
                ids.append(wid if wid is not None else vocab + oov.setdefault(t, len(oov)))
            sentences.append(ids)
        sent = _Sentences(sentences)
        hyp_length = self._bigram_count(sent.lengths)

        # hypothesis n-grams: a local id (identity within this call, for term frequencies) and
        # the global id of the reference corpus (-1: the n-gram occurs in no reference)
        num_words = vocab + len(oov)
        local = sent.tokens.copy()
        glob = np.where(sent.tokens < vocab, sent.tokens, -1)
        e_hyp, e_order, e_glob, e_tf = [], [], [], []
        for k in range(1, n + 1):
            valid = np.flatnonzero(sent.remaining >= k)
            if k > 1:
                last = sent.tokens[valid + k - 1]
                _, local_valid = np.unique(local[valid] * num_words + last, return_inverse=True)
                local = np.full(len(sent.tokens), -1, dtype=np.int64)
                local[valid] = local_valid
                prev = glob[valid]
                known = (prev >= 0) & (last < vocab)
                key = prev * vocab + last
                keys = self._keys[k - 1]
                pos = np.minimum(np.searchsorted(keys, key), max(len(keys) - 1, 0))
                found = known & (len(keys) > 0)
                if len(keys):
                    found &= keys[pos] == key
                glob = np.full(len(sent.tokens), -1, dtype=np.int64)
                glob[valid] = np.where(found, self._offsets[k - 1] + pos, -1)
            if len(valid) == 0:
                continue
            span = int(local[valid].max()) + 1
            uniq, first, counts = np.unique(sent.sentence[valid] * span + local[valid],
                                            return_index=True, return_counts=True)
            e_hyp.append(uniq // span)
            e_order.append(np.full(len(uniq), k - 1, dtype=np.int64))
            e_glob.append(glob[valid][first])
            e_tf.append(counts.astype(np.float64))
        if not e_hyp:
            return np.zeros(num_hyps, dtype=np.float64)
        e_hyp, e_order = np.concatenate(e_hyp), np.concatenate(e_order)
        e_glob, e_tf = np.concatenate(e_glob), np.concatenate(e_tf)

        # references of the images in this call, renumbered 0..R-1 in image order
        images = np.unique(image_index)
        img_ref_start = self._image_ref_ptr[images]
        img_ref_count = self._image_ref_ptr[images + 1] - img_ref_start
        ref_rows = _concat_ranges(img_ref_start, img_ref_start + img_ref_count)
        local_ref_start = np.cumsum(img_ref_count) - img_ref_count
        entry_idx = _concat_ranges(self._ref_ptr[ref_rows], self._ref_ptr[ref_rows + 1])
        entry_ref = np.repeat(np.arange(len(ref_rows), dtype=np.int64),
                              self._ref_ptr[ref_rows + 1] - self._ref_ptr[ref_rows])
        r_gram, r_tf = self._ref_gram[entry_idx], self._ref_tf[entry_idx]
        r_order = np.searchsorted(np.asarray(self._offsets), r_gram, side="right") - 1

        # document frequencies and log(D)
        if df == "fixed":
            log_docs = np.log(float(self.num_images))
            e_df = np.where(e_glob >= 0, self._df[np.maximum(e_glob, 0)], 0.0)
            r_df = self._df[r_gram]
        else:
            log_docs = np.log(float(num_hyps))
            weight = np.bincount(np.searchsorted(images, image_index), minlength=len(images))
            entry_image = np.repeat(np.arange(len(images)), img_ref_count)[entry_ref]
            pairs = np.unique(entry_image * num_grams + r_gram)
            corpus_grams, inverse = np.unique(pairs % num_grams, return_inverse=True)
            corpus_df = np.bincount(inverse, weights=weight[pairs // num_grams]).astype(np.float64)
            r_df = corpus_df[np.searchsorted(corpus_grams, r_gram)]
            e_df = np.zeros(len(e_glob), dtype=np.float64)
            if len(corpus_grams):
                pos = np.minimum(np.searchsorted(corpus_grams, e_glob), len(corpus_grams) - 1)
                hit = (e_glob >= 0) & (corpus_grams[pos] == e_glob)
                e_df[hit] = corpus_df[pos[hit]]
        e_vec = e_tf * (log_docs - np.log(np.maximum(1.0, e_df)))
        r_vec = r_tf * (log_docs - np.log(np.maximum(1.0, r_df)))
        hyp_norm = np.sqrt(np.bincount(e_hyp * n + e_order, weights=e_vec ** 2,
                                       minlength=num_hyps * n)).reshape(num_hyps, n)
        ref_norm = np.sqrt(np.bincount(entry_ref * n + r_order, weights=r_vec ** 2,
                                       minlength=len(ref_rows) * n)).reshape(len(ref_rows), n)
        ref_length = self._ref_length[ref_rows]

        # every (hypothesis, reference of its image) pair, contiguous per hypothesis
        slot = np.searchsorted(images, image_index)
        pair_count = img_ref_count[slot]
        pair_start = np.cumsum(pair_count) - pair_count
        pair_hyp = np.repeat(np.arange(num_hyps, dtype=np.int64), pair_count)
        pair_ref = _concat_ranges(local_ref_start[slot], local_ref_start[slot] + pair_count)

        # clipped dot products: each known hypothesis n-gram against each reference of its image
        known = np.flatnonzero(e_glob >= 0)
        k_hyp = e_hyp[known]
        k_pair = _concat_ranges(pair_start[k_hyp], pair_start[k_hyp] + pair_count[k_hyp])
        k_entry = np.repeat(known, pair_count[k_hyp])
        ref_keys = entry_ref * num_grams + r_gram  # sorted: rows ascending, n-grams ascending
        lookup = pair_ref[k_pair] * num_grams + e_glob[k_entry]
        pos = np.minimum(np.searchsorted(ref_keys, lookup), max(len(ref_keys) - 1, 0))
        hit = ref_keys[pos] == lookup if len(ref_keys) else np.zeros(len(lookup), dtype=bool)
        vh, vr = e_vec[k_entry[hit]], r_vec[pos[hit]]
        numer = np.bincount(k_pair[hit] * n + e_order[k_entry[hit]], weights=np.minimum(vh, vr) * vr,
                            minlength=len(pair_hyp) * n).reshape(len(pair_hyp), n).astype(np.float64)

        denom = hyp_norm[pair_hyp] * ref_norm[pair_ref]
        sim = np.divide(numer, denom, out=numer.copy(), where=denom != 0)
        delta = hyp_length[pair_hyp] - ref_length[pair_ref]
        sim *= np.exp(-(delta ** 2) / (2 * self.sigma ** 2))[:, None]
        per_order = np.add.reduceat(sim, pair_start, axis=0)
        return per_order.mean(axis=1) / pair_count * 10.0


def cider_d(hyps: Sequence[Caption], refs: Sequence[Sequence[Caption]], n: int = 4, sigma: float = 6.0,
            eos_mode: EosMode = "none", eos_token: Hashable = "<eos>") -> tuple[float, np.ndarray]:
    """pycocoevalcap's ``Cider().compute_score`` on lists: hypothesis i against ``refs[i]``, df from
    these references. Returns (mean, per-hypothesis scores)."""
    if len(hyps) != len(refs):
        raise ValueError(f"hyps/refs: {len(hyps)} hypotheses but {len(refs)} reference lists")
    scores = CiderD(refs, n=n, sigma=sigma, eos_mode=eos_mode, eos_token=eos_token).score(
        hyps, np.arange(len(hyps)), df="corpus")
    return float(scores.mean()), scores
