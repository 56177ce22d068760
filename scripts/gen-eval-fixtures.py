#!/usr/bin/env python3
"""Generate the sacreBLEU test vectors under tests/fixtures/eval/.

Run once with sacreBLEU 2.6 installed (pip install sacrebleu==2.6.0):
    python3 scripts/gen-eval-fixtures.py
The Rust tests (tests/eval.rs) compare nmt's statistics to these exactly and its scores to 1e-9.
"""
import json, os, random, subprocess, sys, tempfile

import sacrebleu
from sacrebleu.metrics import BLEU, CHRF

assert sacrebleu.__version__.startswith("2.6"), sacrebleu.__version__
OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "eval")

HAND = [
    ("The cat sat on the mat.", ["The cat sat on the mat.", "A cat was sitting on the mat."]),
    ("It costs $3,000.50 -- or 1,5 million (approx.)!", ["It costs $3,000.50, or 1.5 million (approximately)."]),
    ("See https://example.com/a-b_c?x=1&y=2 for more.", ["See https://example.com/a-b_c?x=1&amp;y=2 for details."]),
    ("well-known state-of-the-art 1990-2000 e-mail", ["well known state of the art 1990 - 2000 email"]),
    ("Don't won't it's the dog's bone 'quoted'", ["Do not won't, it is the dog's bone \"quoted\""]),
    ("«Bonjour», dit-il… « Ça va ? »", ["« Bonjour », a-t-il dit… « Ça va ? »"]),
    ("Preis: 3,5 € – 20 % Rabatt; Temp. 5°C ±2 ™ ©", ["Preis: 3,50 € — 20% Rabatt; Temperatur 5 °C ± 2"]),
    ("我爱北京天安门。", ["我爱北京。"]),
    ("東京で寿司を食べました、とても美味しい！", ["東京で寿司を食べた。美味しかった！"]),
    ("", ["An empty hypothesis against a real reference."]),
    ("A hypothesis against an empty reference.", [""]),
    ("  leading and trailing spaces   ", ["leading  and trailing spaces"]),
    ("tabs\tinside\ttext", ["tabs inside text"]),
    ("ΣΊΣΥΦΟΣ ΌΔΟΣ İstanbul STRASSE Straße", ["σίσυφος οδός istanbul strasse straße"]),
    ("&quot;quoted&quot; &lt;tag&gt; &amp; <skipped> done-\nhere", ["\"quoted\" <tag> & done here"]),
    ("short", ["this reference is very much longer than the hypothesis"]),
    ("this hypothesis is very much longer than its reference , really", ["short reference"]),
    ("emoji 🙂 👍🏽 and symbols ★ ☆ ♥ → ∑", ["emoji 🙂 and symbols ★ ♥ ∑"]),
    ("\u201cSmart quotes\u201d and \u2018single\u2019 — dashes – and… ellipses", ["\"Smart quotes\" and 'single' - dashes - and... ellipses"]),
    ("ends with number 2019.", ["ends with number 2019 ."]),
    ("x.y,z 1.2,3 a.1 1.a", ["x . y , z 1.2,3 a . 1 1 . a"]),
    ("Ünïcödé NFC vs NFD: café cafe\u0301", ["Unicode NFC vs NFD: café café"]),
    ("\u3000全角スペース　と ＡＢＣ １２３", ["全角 スペース と ABC 123"]),
]

WORDS = ("a the man woman dog dogs cat is are running runs in on at park street red blue "
         "two three young old , . ! ? ; : - ' \" ( ) 1 2 10 3.5 1,000 1990-2000 U.S. e-mail "
         "it's don't http://x.org/a?b=c&d=e $5 50% é ü ß ø « » — – … € ™ 中 国 人 の 日本 😀 #tag @user").split()


def sentence(rng, n):
    out = []
    for _ in range(n):
        w = rng.choice(WORDS)
        if rng.random() < 0.15 and out:
            out[-1] += w  # glue tokens together: "word," "(text"
        else:
            out.append(w)
    return " ".join(out)


def random_set(seed, size, nrefs):
    rng = random.Random(seed)
    hyps, refs = [], [[] for _ in range(nrefs)]
    for _ in range(size):
        base = sentence(rng, rng.randint(0, 25))
        words = base.split()
        # Hypothesis: a perturbed copy of the reference (drop, swap, insert), sometimes empty.
        h = [w for w in words if rng.random() > 0.2]
        if len(h) > 2 and rng.random() < 0.5:
            i = rng.randrange(len(h) - 1)
            h[i], h[i + 1] = h[i + 1], h[i]
        if rng.random() < 0.3:
            h += sentence(rng, rng.randint(1, 5)).split()
        hyps.append(" ".join(h) if rng.random() > 0.03 else "")
        refs[0].append(base)
        for k in range(1, nrefs):
            refs[k].append(sentence(rng, rng.randint(0, 20)) if rng.random() < 0.5 else
                           " ".join(w for w in words if rng.random() > 0.1))
    return hyps, refs


def main():
    sets = [
        {"name": "hand", "hyps": [h for h, _ in HAND], "refs": [[r[0] for _, r in HAND]]},
        {"name": "hand-2refs", "hyps": [h for h, _ in HAND],
         "refs": [[r[0] for _, r in HAND], [r[-1] for _, r in HAND]]},
    ]
    for seed, size, nrefs in [(1, 200, 1), (2, 150, 2), (3, 100, 3)]:
        hyps, refs = random_set(seed, size, nrefs)
        sets.append({"name": f"random-{seed}", "hyps": hyps, "refs": refs})

    bleu_cases, chrf_cases = [], []
    for s in sets:
        for tok in ["13a", "intl", "zh", "char", "none"]:
            for lc in [False, True]:
                segments = None
                for smooth, value in [("exp", None), ("floor", None), ("floor", 0.25), ("add-k", None),
                                      ("add-k", 2), ("none", None)]:
                    for eff in [False, True]:
                        m = BLEU(tokenize=tok, lowercase=lc, smooth_method=smooth, smooth_value=value,
                                 effective_order=eff)
                        stats = m._extract_corpus_statistics(s["hyps"], s["refs"])
                        score = m.corpus_score(s["hyps"], s["refs"])
                        total = [sum(col) for col in zip(*stats)]
                        case = {"set": s["name"], "tokenize": tok, "lowercase": lc, "smooth": smooth,
                                "smooth_value": value, "effective_order": eff,
                                "sys_len": total[0], "ref_len": total[1], "correct": total[2:6],
                                "total": total[6:10], "score": score.score, "bp": score.bp,
                                "signature": str(m.get_signature())}
                        if segments is None:
                            segments = [list(map(int, st)) for st in stats]
                            case["segments"] = segments
                        bleu_cases.append(case)
                # Sentence-level BLEU as `sacrebleu -sl` does it (effective order on).
                m = BLEU(tokenize=tok, lowercase=lc, effective_order=True)
                bleu_cases.append({"set": s["name"], "tokenize": tok, "lowercase": lc, "smooth": "exp",
                                   "smooth_value": None, "effective_order": True, "sentence": True,
                                   "sentence_scores": [m.sentence_score(h, [r[i] for r in s["refs"]]).score
                                                       for i, h in enumerate(s["hyps"])]})
        for word_order in [0, 2]:
            for lc in [False, True]:
                for eps in [False, True]:
                    m = CHRF(word_order=word_order, lowercase=lc, eps_smoothing=eps)
                    stats = m._extract_corpus_statistics(s["hyps"], s["refs"])
                    score = m.corpus_score(s["hyps"], s["refs"])
                    chrf_cases.append({"set": s["name"], "word_order": word_order, "lowercase": lc,
                                       "eps_smoothing": eps, "segments": [list(map(int, st)) for st in stats],
                                       "score": score.score, "name": score.name,
                                       "signature": str(m.get_signature())})

    # Bootstrap confidence intervals: resampling differs (numpy's RNG vs ours), so tests compare
    # within resampling noise only.
    s = sets[2]
    ci = {}
    for name, m in [("BLEU", BLEU()), ("chrF2", CHRF())]:
        score = m.corpus_score(s["hyps"], s["refs"], n_bootstrap=1000)
        ci[name] = {"set": s["name"], "score": float(score.score), "mean": float(score._mean), "ci": float(score._ci)}

    # The command line, end to end: sacrebleu's text output on files.
    cli = []
    with tempfile.TemporaryDirectory() as d:
        for s in sets[:3]:
            paths = []
            for i, lines in enumerate([s["hyps"]] + s["refs"]):
                p = os.path.join(d, f"{s['name']}.{i}")
                with open(p, "w", encoding="utf-8") as f:
                    f.write("".join(l.replace("\n", " ") + "\n" for l in lines))
                paths.append(p)
            out = subprocess.run([sys.executable, "-m", "sacrebleu", *paths[1:], "-i", paths[0], "-m", "bleu", "chrf",
                                  "-w", "2", "-f", "text"], capture_output=True, text=True, check=True).stdout
            cli.append({"set": s["name"], "files": len(paths), "stdout": out})

    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "sacrebleu-2.6.json"), "w", encoding="utf-8") as f:
        json.dump({"sacrebleu": sacrebleu.__version__, "sets": sets, "bleu": bleu_cases, "chrf": chrf_cases,
                   "bootstrap": ci, "cli": cli}, f, ensure_ascii=False)
    print(f"{len(bleu_cases)} BLEU cases, {len(chrf_cases)} chrF cases written to {OUT}")


if __name__ == "__main__":
    main()
