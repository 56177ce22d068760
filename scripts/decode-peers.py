#!/usr/bin/env python3
"""Decode sentences with transformers' generate or CTranslate2 on one HF Marian folder.

    decode-peers.py MODEL_DIR SOURCES OUT_DIR --engine hf|ct2 [--threads 2] [--batch 64]
                    [--max-new-tokens 128] [--compute-type float32|int8|int8_float32|...]

Writes OUT_DIR/ENGINE.beam{1,5}.txt (CTranslate2 with another compute type than float32:
ct2-TYPE.beam{1,5}.txt) and prints one JSON line with sentences/s. CTranslate2 runs in both
of its thread layouts, one translator on all threads (inter_threads=1, intra_threads=N) and N
translators on one thread each (inter_threads=N, intra_threads=1, batches decoded side by
side), and the faster counts, with its layout (ENGINE_beamB_layout); on a 2-core AMD Zen 4
its int8 decoded 5x faster in the second. Used by
scripts/bench-translate.sh; needs tokenizers and torch + transformers (hf) or ctranslate2 (ct2).
Run each engine in a process of its own: after torch has run in a process, CTranslate2 in that
process decodes 1.6–2.5× slower (measured; two OpenMP runtimes compete for the cores).
"""
import argparse, json, os, subprocess, sys, time

from tokenizers import Tokenizer

ap = argparse.ArgumentParser()
ap.add_argument("model"); ap.add_argument("sources"); ap.add_argument("out")
ap.add_argument("--engine", choices=["hf", "ct2"], required=True)
ap.add_argument("--threads", type=int, default=2); ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--max-new-tokens", type=int, default=128)
ap.add_argument("--compute-type", default="float32", help="CTranslate2's compute_type")
a = ap.parse_args()
os.makedirs(a.out, exist_ok=True)
tok = Tokenizer.from_file(os.path.join(a.model, "tokenizer.json"))
lines = [l.rstrip("\n") for l in open(a.sources, encoding="utf-8")]
res = {}


def transformers_generate():
    import torch
    from transformers import MarianMTModel
    torch.set_num_threads(a.threads)
    model = MarianMTModel.from_pretrained(a.model).eval()
    pad, eos = model.config.pad_token_id, model.config.eos_token_id
    ids = [e.ids + [eos] for e in tok.encode_batch(lines, add_special_tokens=False)]
    for beams in (1, 5):
        generate(torch, model, ids, pad, beams)


def generate(torch, model, ids, pad, beams):
    outs, t = [], time.time()
    with torch.no_grad():
        for i in range(0, len(ids), a.batch):
            chunk = ids[i:i + a.batch]
            x = torch.tensor([s + [pad] * (max(map(len, chunk)) - len(s)) for s in chunk])
            g = model.generate(input_ids=x, attention_mask=(x != pad), num_beams=beams, do_sample=False,
                               max_new_tokens=a.max_new_tokens, bad_words_ids=[[pad]])
            outs += tok.decode_batch(g.tolist(), skip_special_tokens=True)
    res[f"hf_beam{beams}_sent_per_s"] = round(len(outs) / (time.time() - t), 1)
    open(os.path.join(a.out, f"hf.beam{beams}.txt"), "w").write("".join(o + "\n" for o in outs))


def ctranslate2_translate():
    import ctranslate2
    ct2dir = os.path.join(a.out, "ct2-model")
    conv = os.path.join(os.path.dirname(sys.executable), "ct2-transformers-converter")
    subprocess.run([conv, "--model", a.model, "--output_dir", ct2dir, "--force"], check=True, capture_output=True)
    name, file = ("ct2", "ct2") if a.compute_type == "float32" else (f"ct2_{a.compute_type}", f"ct2-{a.compute_type}")
    src_toks = [tok.encode(s, add_special_tokens=False).tokens + ["</s>"] for s in lines]
    layouts = [(1, a.threads)] + ([(a.threads, 1)] if a.threads > 1 else [])
    for inter, intra in layouts:
        tr = ctranslate2.Translator(ct2dir, device="cpu", inter_threads=inter, intra_threads=intra,
                                    compute_type=a.compute_type)
        for beams in (1, 5):
            t = time.time()
            r = tr.translate_batch(src_toks, beam_size=beams, max_batch_size=a.batch, max_decoding_length=a.max_new_tokens)
            s = time.time() - t
            outs = [tok.decode([tok.token_to_id(x) for x in o.hypotheses[0]], skip_special_tokens=True) for o in r]
            rate, key = round(len(outs) / s, 1), f"{name}_beam{beams}_sent_per_s"
            if rate > res.get(key, 0):
                res[key], res[f"{name}_beam{beams}_layout"] = rate, f"{inter}x{intra}"
            if (inter, intra) == layouts[0]:  # the same translations in either layout
                open(os.path.join(a.out, f"{file}.beam{beams}.txt"), "w").write("".join(o + "\n" for o in outs))
        del tr


if a.engine == "hf":
    transformers_generate()
else:
    try:
        ctranslate2_translate()
    except Exception as e:  # keep the other figures
        res["ct2_error"] = repr(e)[:300]
print(json.dumps(res))
