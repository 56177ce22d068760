#!/usr/bin/env python3
"""Generate tests/fixtures/opus-tiny: a tiny OPUS-MT-style model as Helsinki-NLP publishes them
(config.json, pytorch_model.bin, source.spm, target.spm, vocab.json, tokenizer_config.json), with
what transformers' MarianTokenizer and generate() make of a set of tricky sentences.

    python3 scripts/gen-opus-fixture.py

The SentencePiece models are unigram models trained here on a small synthetic corpus with the
default nmt_nfkc normalisation (so the precompiled character map is exercised). vocab.json
follows Marian: </s>=0, <unk>=1, the pieces of both models, <pad> last; a few source pieces
are left out so that pieces missing from the vocabulary map to <unk>. The weights are random.
tests/opus.rs requires nmt to reproduce every recorded piece, id, search output and text.

Needs torch, transformers, sentencepiece and protobuf.
"""
import json, os, random, shutil, tempfile

import sentencepiece as spm
import torch
import transformers
from transformers import MarianConfig, MarianMTModel, MarianTokenizer

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "opus-tiny")

DE = ("ein eine zwei drei junge alte Mann Frau Kinder Hund Katze läuft spielt sitzt über "
      "die der das Straße Fußball grünen großen weißen schöne Mädchen Jungen Wasser im am "
      "mit auf unter neben Häuser Bäume Öl Ärger Übung fährt Fahrrad trägt Hut Café").split()
EN = ("a an two three young old man woman children dog cat runs plays sits over the street "
      "football green big white beautiful girl boy water in on with under next to houses trees "
      "oil anger exercise rides bicycle wears hat café").split()
PUNCT = [".", ",", "!", "?", "-", "'s", ":", ";"]

SENTENCES = [
    "Zwei junge Männer spielen Fußball.",
    "  Ein Hund   läuft über die Straße.  ",
    "Eine Frau\tträgt einen Hut.",
    "Café\u00a0im Park, 12 Kinder!",
    "Cafe\u0301 und Ärger",
    "ＡＢＣ １２３ full-width",
    "東京 und 🙂 unbekannt",
    "ein </s> im Satz",
    "mit <unk> und <pad>",
    ">>de<< Ein Mädchen sitzt.",
    "",
    "   ",
    "Übung macht den Meister...",
    "Die Katze (weiß) sitzt auf dem Dach; 3,5 m hoch.",
    "zzzz qqq xxx",
    "Straße\u2581mit Unterstrich",
    "Ein\u3000Mann",
    "Häuser, Bäume und Öl.",
    "a" * 40,
    "Zwei Hunde spielen im Wasser neben einem großen Baum",
]


def corpus(words, n, rng):
    lines = []
    for _ in range(n):
        ws = [rng.choice(words) for _ in range(rng.randint(3, 12))]
        if rng.random() < 0.5:
            ws[-1] += rng.choice(PUNCT)
        if rng.random() < 0.2:
            ws.insert(rng.randrange(len(ws)), str(rng.randint(0, 999)))
        lines.append(" ".join(ws).capitalize())
    return lines


def train_spm(lines, prefix, size):
    with open(prefix + ".txt", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    spm.SentencePieceTrainer.train(input=prefix + ".txt", model_prefix=prefix, vocab_size=size,
                                   model_type="unigram", character_coverage=0.9995,
                                   minloglevel=2)
    return prefix + ".model"


def main():
    rng = random.Random(7)
    tmp = tempfile.mkdtemp()
    src_model = train_spm(corpus(DE, 3000, rng), os.path.join(tmp, "source"), 160)
    tgt_model = train_spm(corpus(EN, 3000, rng), os.path.join(tmp, "target"), 150)
    vocab = {"</s>": 0, "<unk>": 1}
    for path, skip_every in [(src_model, 29), (tgt_model, 0)]:
        sp = spm.SentencePieceProcessor(model_file=path)
        for i in range(sp.get_piece_size()):
            piece = sp.id_to_piece(i)
            if sp.is_control(i) or sp.is_unknown(i) or piece in vocab:
                continue
            if skip_every and i % skip_every == 0:
                continue
            vocab[piece] = len(vocab)
    vocab[">>de<<"] = len(vocab)
    vocab["<pad>"] = len(vocab)
    pad = vocab["<pad>"]

    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    shutil.copy(src_model, os.path.join(tmp, "source.spm"))
    shutil.copy(tgt_model, os.path.join(tmp, "target.spm"))
    with open(os.path.join(tmp, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False, indent=2)
    tok = MarianTokenizer(os.path.join(tmp, "source.spm"), os.path.join(tmp, "target.spm"),
                          os.path.join(tmp, "vocab.json"), source_lang="de", target_lang="en")
    tok.save_pretrained(OUT)
    for extra in ["special_tokens_map.json", "tokenizer.json", "chat_template.jinja"]:
        if os.path.exists(os.path.join(OUT, extra)):
            os.remove(os.path.join(OUT, extra))

    torch.manual_seed(0)
    config = MarianConfig(vocab_size=len(vocab), decoder_vocab_size=len(vocab), d_model=16,
                          encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32,
                          max_position_embeddings=64, scale_embedding=True, pad_token_id=pad,
                          eos_token_id=0, decoder_start_token_id=pad, forced_eos_token_id=0,
                          share_encoder_decoder_embeddings=True, tie_word_embeddings=True)
    model = MarianMTModel(config).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(0, 0.5)
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0, 0.1)
    # Older OPUS-MT repos publish PyTorch pickles (torch.save of the state dict), not
    # safetensors: exercise that path.
    model.config.save_pretrained(OUT)
    torch.save(model.state_dict(), os.path.join(OUT, "pytorch_model.bin"))

    sp_src = spm.SentencePieceProcessor(model_file=src_model)
    cases = []
    for line in SENTENCES:
        cases.append({"text": line, "spm_pieces": sp_src.encode(line, out_type=str),
                      "ids": tok(line).input_ids})
    sources = [c["ids"] for c in cases if c["text"].strip()]
    width = max(map(len, sources))
    src = torch.tensor([s + [pad] * (width - len(s)) for s in sources])
    searches = []
    for beams, lp in [(1, 1.0), (4, 1.0), (4, 0.6)]:
        with torch.no_grad():
            out = model.generate(input_ids=src, attention_mask=(src != pad), num_beams=beams,
                                 length_penalty=lp, max_new_tokens=20, do_sample=False,
                                 bad_words_ids=[[pad]])
        outputs, texts = [], []
        for row in out.tolist():
            ids = row[1:]
            ids = ids[:ids.index(0)] if 0 in ids else [t for t in ids if t != pad]
            outputs.append(ids)
            texts.append(tok.decode(ids, skip_special_tokens=True, use_source_tokenizer=False))
        searches.append({"beam": beams, "length_penalty": lp, "max_new_tokens": 20,
                         "outputs": outputs, "texts": texts})
    rng = random.Random(11)
    decodes = []
    for _ in range(30):
        ids = [rng.randrange(len(vocab)) for _ in range(rng.randint(0, 12))]
        decodes.append({"ids": ids,
                        "text": tok.decode(ids, skip_special_tokens=True, use_source_tokenizer=False)})
    with open(os.path.join(OUT, "transformers.json"), "w", encoding="utf-8") as f:
        json.dump({"transformers": transformers.__version__, "sentencepiece": spm.__version__,
                   "sources": sources, "cases": cases, "searches": searches, "decodes": decodes},
                  f, ensure_ascii=False)
    print("wrote", OUT, sorted(os.listdir(OUT)))


if __name__ == "__main__":
    main()
