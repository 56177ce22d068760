#!/usr/bin/env python3
"""Generate the model-parity fixtures under tests/fixtures/ with transformers.

    python3 scripts/gen-model-fixtures.py            # HF -> nmt: tiny random Marian + logits
    python3 scripts/gen-model-fixtures.py --check-nmt DIR --sources FILE
        # nmt -> HF: load a checkpoint nmt wrote with MarianMTModel.from_pretrained and record
        # its logits and generate() outputs (greedy, beam 4/5, several length penalties) in
        # DIR/transformers.json; tests/translate.rs requires nmt to reproduce them.

scripts/gen-nmt-toy-fixture.sh makes tests/fixtures/nmt-toy (a toy model trained by nmt) and runs
the second form on it.

Needs torch and transformers (pip install torch transformers).
"""
import argparse, json, os, sys

import torch
import transformers
from transformers import MarianConfig, MarianMTModel

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")


def tiny(normalize_before=False, activation="relu"):
    return MarianConfig(vocab_size=61, decoder_vocab_size=61, d_model=16, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
                        decoder_ffn_dim=32, max_position_embeddings=32, activation_function=activation,
                        scale_embedding=True, pad_token_id=60, eos_token_id=0, decoder_start_token_id=60,
                        forced_eos_token_id=0, share_encoder_decoder_embeddings=True, tie_word_embeddings=True,
                        dropout=0.1)


INPUT = {
    # Two source sentences, the second padded; decoder inputs start with the pad id (Marian).
    "src": [[5, 17, 33, 8, 42, 0], [9, 21, 0, 60, 60, 60]],
    "tgt_in": [[60, 7, 13, 29, 0], [60, 44, 3, 60, 60]],
}


def logits_of(model):
    src = torch.tensor(INPUT["src"]); tgt = torch.tensor(INPUT["tgt_in"])
    with torch.no_grad():
        out = model(input_ids=src, attention_mask=(src != 60), decoder_input_ids=tgt,
                    decoder_attention_mask=(tgt != 60) | (torch.arange(tgt.shape[1]) == 0)).logits
    return out


def generate_cases(model, sources, pad, eos):
    """Greedy and beam outputs of transformers' generate, for search parity (ids, `</s>` removed)."""
    width = max(map(len, sources))
    src = torch.tensor([s + [pad] * (width - len(s)) for s in sources])
    cases = []
    for beams, lp, new in [(1, 1.0, 24), (4, 1.0, 24), (4, 0.6, 24), (4, 2.0, 24), (5, 1.0, 24), (5, 1.0, 6)]:
        with torch.no_grad():
            out = model.generate(input_ids=src, attention_mask=(src != pad), num_beams=beams, length_penalty=lp,
                                 max_new_tokens=new, do_sample=False, bad_words_ids=[[pad]])
        outputs = []
        for row in out.tolist():
            ids = row[1:]
            outputs.append(ids[:ids.index(eos)] if eos in ids else [t for t in ids if t != pad])
        cases.append({"beam": beams, "length_penalty": lp, "max_new_tokens": new, "outputs": outputs})
    return cases


def hf_to_nmt():
    for name, act in [("marian-tiny", "relu"), ("marian-tiny-gelu", "gelu")]:
        torch.manual_seed(0)
        model = MarianMTModel(tiny(activation=act)).eval()
        with torch.no_grad():  # non-zero biases so that every tensor matters
            model.final_logits_bias.normal_(0, 0.5)
            for n, p in model.named_parameters():
                if n.endswith(".bias"):
                    p.normal_(0, 0.1)
        out = os.path.join(FIX, name)
        model.save_pretrained(out)
        with open(os.path.join(out, "logits.json"), "w") as f:
            json.dump({"transformers": transformers.__version__, **INPUT,
                       "logits": logits_of(model).tolist()}, f)
        print("wrote", out)


def nmt_to_hf(path, sources_file):
    """Load a checkpoint nmt wrote with MarianMTModel.from_pretrained; record its logits and
    generate() outputs on the sources so that the Rust tests can require nmt to equal them."""
    from tokenizers import Tokenizer
    model = MarianMTModel.from_pretrained(path).eval()
    cfg = model.config
    pad, eos = cfg.pad_token_id, cfg.eos_token_id
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    lines = [l.rstrip("\n") for l in open(sources_file, encoding="utf-8")]
    sources = [e.ids + [eos] for e in tok.encode_batch(lines, add_special_tokens=False)]
    src = torch.tensor([s + [pad] * (max(map(len, sources)) - len(s)) for s in sources[:4]])
    tgt = torch.tensor([[pad] + s[:5] for s in sources[4:8]])
    with torch.no_grad():
        logits = model(input_ids=src, attention_mask=(src != pad), decoder_input_ids=tgt).logits
    result = {"transformers": transformers.__version__, "loaded_with": "MarianMTModel.from_pretrained",
              "sources": sources, "logits_src": src.tolist(), "logits_tgt_in": tgt.tolist(),
              "logits": logits.tolist(), "cases": generate_cases(model, sources, pad, eos)}
    with open(os.path.join(path, "transformers.json"), "w") as f:
        json.dump(result, f)
    print(f"transformers {transformers.__version__} loaded {path}; wrote transformers.json")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-nmt", metavar="DIR")
    ap.add_argument("--sources", metavar="FILE", help="source sentences for --check-nmt")
    a = ap.parse_args()
    nmt_to_hf(a.check_nmt, a.sources) if a.check_nmt else hf_to_nmt()
