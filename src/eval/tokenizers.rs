//! sacreBLEU's metric tokenizers (`13a`, `intl`, `zh`, `char`, `none`), character for character
//! as sacreBLEU 2.6 does them, including its quirks (see `is_chinese_char`).

use regex::Regex;
use std::sync::LazyLock;

/// Which tokenizer BLEU applies before counting n-grams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum MetricTokenizer {
    /// mteval-v13a, the WMT standard (default).
    #[value(name = "13a")]
    Tok13a,
    /// mteval-v14 international: splits on Unicode punctuation and symbols.
    Intl,
    /// Chinese: every CJK character is a token, the rest as 13a.
    Zh,
    /// Every character is a token.
    Char,
    /// No tokenization.
    None,
}

impl MetricTokenizer {
    /// The name in signatures.
    pub fn signature(self) -> &'static str {
        match self {
            Self::Tok13a => "13a",
            Self::Intl => "intl",
            Self::Zh => "zh",
            Self::Char => "char",
            Self::None => "none",
        }
    }

    /// Tokenizes one line.
    pub fn tokenize(self, line: &str) -> String {
        match self {
            Self::Tok13a => tokenize_13a(line),
            Self::Intl => tokenize_intl(line),
            Self::Zh => tokenize_zh(line),
            Self::Char => {
                let mut out = String::with_capacity(line.len() * 2);
                for (i, c) in line.chars().enumerate() {
                    if i > 0 {
                        out.push(' ');
                    }
                    out.push(c);
                }
                out
            }
            Self::None => line.to_string(),
        }
    }
}

/// Python's `str.isspace`: Unicode White_Space plus the four ASCII separators 0x1C..0x1F.
pub fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.split()` with no argument.
pub fn py_split(s: &str) -> impl Iterator<Item = &str> {
    s.split(is_py_space).filter(|w| !w.is_empty())
}

/// Python's `str.rstrip()` with no argument.
pub fn py_rstrip(s: &str) -> &str {
    s.trim_end_matches(is_py_space)
}

fn join_words(s: &str) -> String {
    py_split(s).collect::<Vec<_>>().join(" ")
}

static RE_13A: LazyLock<[(Regex, &str); 4]> = LazyLock::new(|| {
    [
        (Regex::new(r"([{-~\[-` -&(-+:-@/])").unwrap(), " ${1} "),
        (Regex::new(r"([^0-9])([.,])").unwrap(), "${1} ${2} "),
        (Regex::new(r"([.,])([^0-9])").unwrap(), " ${1} ${2}"),
        (Regex::new(r"([0-9])(-)").unwrap(), "${1} ${2} "),
    ]
});

static RE_INTL: LazyLock<[(Regex, &str); 3]> = LazyLock::new(|| {
    [
        (Regex::new(r"(\P{N})(\p{P})").unwrap(), "${1} ${2} "),
        (Regex::new(r"(\p{P})(\P{N})").unwrap(), " ${1} ${2}"),
        (Regex::new(r"(\p{S})").unwrap(), " ${1} "),
    ]
});

fn apply(rules: &[(Regex, &str)], line: &str) -> String {
    let mut s = line.to_string();
    for (re, rep) in rules {
        if let std::borrow::Cow::Owned(t) = re.replace_all(&s, *rep) {
            s = t;
        }
    }
    join_words(&s)
}

/// sacreBLEU's `TokenizerRegexp`, the common part of `13a` and `zh`.
fn tokenize_re(line: &str) -> String {
    apply(&RE_13A[..], line)
}

fn tokenize_13a(line: &str) -> String {
    let mut s = line
        .replace("<skipped>", "")
        .replace("-\n", "")
        .replace('\n', " ");
    if s.contains('&') {
        s = s
            .replace("&quot;", "\"")
            .replace("&amp;", "&")
            .replace("&lt;", "<")
            .replace("&gt;", ">");
    }
    tokenize_re(&format!(" {s} "))
}

fn tokenize_intl(line: &str) -> String {
    apply(&RE_INTL[..], line)
}

/// sacreBLEU's `_is_chinese_char`. Two of its ranges are written `u'\u20000'` and `u'\u2f800'`
/// in Python, which are two-character strings ('\u2000' + '0'), so string comparison makes them
/// cover U+2001..=U+2A6D and U+2F81..=U+2FA1 instead of the supplementary planes; we do the same
/// so that scores stay identical.
fn is_chinese_char(c: char) -> bool {
    const RANGES: &[(u32, u32)] = &[
        (0x3400, 0x4db5),
        (0x4e00, 0x9fa5),
        (0x9fa6, 0x9fbb),
        (0xf900, 0xfa2d),
        (0xfa30, 0xfa6a),
        (0xfa70, 0xfad9),
        (0x2001, 0x2a6d),
        (0x2f81, 0x2fa1),
        (0xff00, 0xffef),
        (0x2e80, 0x2eff),
        (0x3000, 0x303f),
        (0x31c0, 0x31ef),
        (0x2f00, 0x2fdf),
        (0x2ff0, 0x2fff),
        (0x3100, 0x312f),
        (0x31a0, 0x31bf),
        (0xfe10, 0xfe1f),
        (0xfe30, 0xfe4f),
        (0x2600, 0x26ff),
        (0x2700, 0x27bf),
        (0x3200, 0x32ff),
        (0x3300, 0x33ff),
    ];
    let c = c as u32;
    RANGES.iter().any(|&(a, b)| (a..=b).contains(&c))
}

fn tokenize_zh(line: &str) -> String {
    let line = line.trim_matches(is_py_space);
    let mut s = String::with_capacity(line.len() * 2);
    for c in line.chars() {
        if is_chinese_char(c) {
            s.push(' ');
            s.push(c);
            s.push(' ');
        } else {
            s.push(c);
        }
    }
    tokenize_re(&s)
}

#[cfg(test)]
mod tests {
    use super::MetricTokenizer::*;

    #[test]
    fn thirteen_a_splits_punctuation_but_not_numbers() {
        assert_eq!(
            Tok13a.tokenize(
                "Hello, world! It costs $3,000.50 (approx.) &amp; more-or-less 1990-2000."
            ),
            "Hello , world ! It costs $ 3,000.50 ( approx . ) & more-or-less 1990 - 2000 ."
        );
    }

    #[test]
    fn intl_splits_unicode_punctuation_and_symbols() {
        assert_eq!(
            Intl.tokenize("«Bonjour», dit-il… 3.5€"),
            "« Bonjour » , dit - il … 3.5 €"
        );
    }

    #[test]
    fn zh_and_char() {
        assert_eq!(Zh.tokenize(" 我爱北京 abc, "), "我 爱 北 京 abc ,");
        assert_eq!(Char.tokenize("ab c"), "a b   c");
    }
}
