#!/usr/bin/env python3
"""For scripts/bench-align.sh: align the test sources with a model's translations using
eflomal (trained on the training corpus plus these pairs, both directions symmetrised with
grow-diag-final-and), and score the model's own `--alignment hard` output against it:
precision, recall, F1 and AER (the eflomal links taken as sure links).
    align-score.py TRAIN_SRC TRAIN_TGT TEST_SRC HYP_WITH_ALIGNMENT
    align-score.py --write-links SRC TGT OUT   # eflomal's links of a corpus, for
                                               # nmt train --guided-alignment
HYP_WITH_ALIGNMENT: `nmt translate --alignment hard` output, `translation ||| s-t ...` lines.
Prints one JSON line. Needs eflomal (pip install eflomal).
"""
import gzip
import json
import os
import sys
import tempfile

import eflomal


def lines(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [l.rstrip("\n") for l in f]


def read_links(path):
    out = []
    for line in open(path, encoding="utf-8"):
        pairs = set()
        for p in line.split():
            s, t = p.split("-")
            pairs.add((int(s), int(t)))
        out.append(pairs)
    return out


def grow_diag_final_and(fwd, rev):
    """Koehn et al.'s symmetrisation of two directional alignments (sets of (s, t))."""
    union, alignment = fwd | rev, fwd & rev
    neighbours = [(-1, 0), (0, -1), (1, 0), (0, 1), (-1, -1), (-1, 1), (1, -1), (1, 1)]
    aligned_s = {s for s, _ in alignment}
    aligned_t = {t for _, t in alignment}
    added = True
    while added:
        added = False
        for s, t in sorted(alignment):
            for ds, dt in neighbours:
                p = (s + ds, t + dt)
                if p in union and p not in alignment and (p[0] not in aligned_s or p[1] not in aligned_t):
                    alignment.add(p)
                    aligned_s.add(p[0])
                    aligned_t.add(p[1])
                    added = True
    for direction in (fwd, rev):
        for s, t in sorted(direction):
            if s not in aligned_s and t not in aligned_t:
                alignment.add((s, t))
                aligned_s.add(s)
                aligned_t.add(t)
    return alignment


def eflomal_links(src, tgt):
    """grow-diag-final-and links of eflomal's two directions, one set per line."""
    with tempfile.TemporaryDirectory() as work:
        fwd, rev = os.path.join(work, "fwd"), os.path.join(work, "rev")
        # eflomal reads whitespace-tokenised text, one sentence per line; an empty side is
        # aligned to nothing.
        eflomal.Aligner().align([l if l.strip() else "." for l in src], [l if l.strip() else "." for l in tgt],
                                links_filename_fwd=fwd, links_filename_rev=rev, quiet=True)
        return [grow_diag_final_and(a, b) for a, b in zip(read_links(fwd), read_links(rev))]


def main():
    if sys.argv[1] == "--write-links":
        src, tgt, out = sys.argv[2:5]
        with open(out, "w", encoding="utf-8") as f:
            for links in eflomal_links(lines(src), lines(tgt)):
                f.write(" ".join(f"{s}-{t}" for s, t in sorted(links)) + "\n")
        return
    train_src, train_tgt, test_src, hyp_file = sys.argv[1:5]
    test = lines(test_src)
    hyps, ours = [], []
    for line in lines(hyp_file):
        text, _, links = line.partition(" ||| ")
        hyps.append(text)
        ours.append({tuple(map(int, p.split("-"))) for p in links.split()})
    assert len(hyps) == len(test), f"{len(hyps)} translations for {len(test)} sources"
    src = lines(train_src) + test
    tgt = lines(train_tgt) + hyps
    ref = eflomal_links(src, tgt)[-len(test):]
    hit = sum(len(a & b) for a, b in zip(ours, ref))
    n_ours, n_ref = sum(map(len, ours)), sum(map(len, ref))
    p, rc = hit / max(n_ours, 1), hit / max(n_ref, 1)
    print(json.dumps({"precision": round(p, 4), "recall": round(rc, 4),
                      "f1": round(2 * p * rc / max(p + rc, 1e-9), 4),
                      "aer": round(1 - 2 * hit / max(n_ours + n_ref, 1), 4),
                      "links_nmt": n_ours, "links_eflomal": n_ref}))


if __name__ == "__main__":
    main()
