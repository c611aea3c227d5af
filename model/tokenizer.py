"""GGUF byte-level BPE tokenizer ("gpt2" model) for the deepseek2-architecture models, token-exact with llama.cpp.

Pre-tokenization mirrors llama.cpp's unicode_regex_split: each regex of the chain splits every current piece into its
matches and the gaps between them. Regexes using \\p{..} run on a "collapsed" copy of the text (every non-ASCII
codepoint replaced by one byte per unicode category, so \\p{Lu} and \\p{Ll} both mean "letter"), the others on a copy
whose non-ASCII whitespace is replaced by \\v; \\s is ASCII-only in both.
"""
from __future__ import annotations

import codecs
import heapq
import re
import unicodedata
from typing import Any

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(1, 7)  # tokenizer.ggml.token_type values

# *** GPT-2 byte <-> unicode mapping ***

def _bytes_to_unicode() -> dict[int, str]:
  bs = [*range(0x21, 0x7f), *range(0xa1, 0xad), *range(0xae, 0x100)]
  return {**{b: chr(b) for b in bs}, **{b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in bs)}}

_B2U = _bytes_to_unicode()
_ENC = str.maketrans({chr(b): u for b, u in _B2U.items()})  # latin-1 view of utf-8 bytes -> byte-level chars
_DEC = str.maketrans({u: chr(b) for b, u in _B2U.items()})

def _byte_encode(s: str) -> str: return s.encode("utf-8", "surrogatepass").decode("latin-1").translate(_ENC)

def _byte_decode(s: str) -> bytes:
  try: return s.translate(_DEC).encode("latin-1")
  except UnicodeEncodeError:
    return b"".join(c.translate(_DEC).encode("latin-1") if ord(c.translate(_DEC)) < 256 else c.encode() for c in s)

# *** pre-tokenizer regexes (llama-vocab.cpp, llm_tokenizer_bpe) ***

# non-ASCII whitespace per llama.cpp
_WS = {0x85, 0xa0, 0x1680, *range(0x2000, 0x200b), 0x2028, 0x2029, 0x202f, 0x205f, 0x3000}
_CAT_BYTE = {"N": "\xd1", "L": "\xd2", "P": "\xd3", "M": "\xd4", "S": "\xd5"}
_CAT_ASCII = {"N": "0-9", "L": "A-Za-z", "P": r"!-#%-*,-/:;?@\[-\]_{}", "M": "", "S": r"$+<=>^`|~"}

class _Collapse(dict):
  def __missing__(self, c: int) -> str:
    self[c] = v = chr(c) if c < 128 else "\v" if c in _WS else _CAT_BYTE.get(unicodedata.category(chr(c))[0], "\xd0")
    return v

_COLLAPSE, _WS_ONLY = _Collapse(), {c: "\v" for c in _WS}

def _compile(pat: str) -> tuple[re.Pattern[str], bool]:
  """Rewrite \\p{X} into collapsed-category classes like llama.cpp; returns (regex, runs_on_collapsed_text)."""
  out, inside, i = [], False, 0
  while i < len(pat):
    if pat.startswith(r"\p{", i):
      cls = _CAT_BYTE[pat[i+3]] + _CAT_ASCII[pat[i+3]]
      out.append(cls if inside else f"[{cls}]")
      i = pat.index("}", i) + 1
    elif pat[i] == "\\": out.append(pat[i:i+2]); i += 2
    else:
      if pat[i] in "[]": inside = pat[i] == "["
      out.append(pat[i]); i += 1
  return re.compile("".join(out), re.ASCII), r"\p{" in pat

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_DEEPSEEK_LLM = [  # non-ASCII as escapes: the letter class holds codepoints that unicode normalization would rewrite
  r"[\r\n]",
  r"\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d"
  r"\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
  r"\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57"
  r"\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
  r"\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
  r"\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
  r"\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
  r"\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
  r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
  r"\s+\Z",
  r"[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
  r"\p{N}+",
]
_CJK = r"\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff"
_DEEPSEEK_V3 = [
  r"\p{N}{1,3}",
  rf"[{_CJK}]+",
  r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
  r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_UP, _LO = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_YOUTU = [
  rf"[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|[{_CJK}]+",
  rf"[^\r\n\p{{L}}\p{{N}}]?{_UP}*{_LO}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_UP}+{_LO}*{_CONTRACTIONS}?"
  r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"]

# tokenizer.ggml.pre -> (regex chain, ignore_merges: a pre-token that is itself in the vocab is emitted whole)
PRE_TOKENIZERS: dict[str, tuple[list[str], bool]] = {
  "default": (_DEFAULT, False), "gpt-2": ([_GPT2], False), "gpt2": ([_GPT2], False),
  "chatglm-bpe": ([_LLAMA3], False), "glm4": ([_LLAMA3], True), "glm5": ([_LLAMA3], True),
  "deepseek-llm": (_DEEPSEEK_LLM, False), "deepseek-v3": (_DEEPSEEK_V3, False), "youtu": (_YOUTU, True),
}
_COMPILED = {k: [_compile(p) for p in v[0]] for k, v in PRE_TOKENIZERS.items()}

# token texts llama.cpp treats as end-of-generation, plus GLM's turn starts (its eot/eom tokens)
_EOG_TEXTS = {"<|endoftext|>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>",
              "<|end|>", "<end_of_turn>", "<|user|>", "<|observation|>"}

# (chat style, marker in tokenizer.chat_template, token texts all in the vocab): the first template match wins, else the
# first vocab match
_CHAT_STYLES = [("glm", "[gMASK]<sop>", {"[gMASK]", "<sop>", "<|user|>", "<|assistant|>"}),
                ("deepseek3", "<｜Assistant｜>", {"<｜User｜>", "<｜Assistant｜>"}),
                ("deepseek2", "'Assistant: ' + message['content'] + eos_token", {"<｜begin▁of▁sentence｜>"}),
                ("youtu", "<|Assistant|>", {"<|User|>", "<|Assistant|>"})]

def _cut(text: str | int, special: str, tid: int) -> list[str | int]:
  if isinstance(text, int): return [text]
  out: list[str | int] = []
  for j, s in enumerate(text.split(special)): out += ([tid] if j else []) + ([s] if s else [])
  return out

class Tokenizer:
  def __init__(self, tokens: list[str], types: list[int], merges: list[str], pre: str = "default",
               bos_id: int | None = None, eos_id: int | None = None, add_bos: bool = False,
               stop_ids: set[int] | None = None, chat_template: str | None = None):
    if pre not in PRE_TOKENIZERS:
      raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}, expected one of {sorted(PRE_TOKENIZERS)}")
    self.tokens, self.types, self.pre = tokens, types, pre
    self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
    self.chat_template = chat_template  # only used to pick the chat style; callers with a jinja engine can render it
    self.regexes, self.ignore_merges = _COMPILED[pre], PRE_TOKENIZERS[pre][1]
    self.tok2id = {t: i for i, t in enumerate(tokens)}
    # "left right" -> rank, first occurrence wins like llama.cpp
    self.ranks = {m: i for i, m in reversed(list(enumerate(merges)))}
    self.stop_ids = {i for i in (stop_ids or set()) | {eos_id}
                     if i is not None} | {self.tok2id[t] for t in _EOG_TEXTS if t in self.tok2id}
    # dropped by decode(special=False)
    self.hidden = frozenset(i for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)) | self.stop_ids
    # special tokens matched literally in text, longest first (llama.cpp tokenizer_st_partition)
    special = [i for i, t in enumerate(types) if (t == USER_DEFINED or i in self.hidden) and tokens[i]]
    self.specials = [(tokens[i], i) for i in sorted(special, key=lambda i: (-len(tokens[i]), i))]
    self.user_defined = [(t, i) for t, i in self.specials if types[i] == USER_DEFINED]
    self.pieces: dict[int, bytes] = {}  # filled lazily by _piece
    self.cache: dict[str, list[int]] = {}
    self.chat_style = next((s for s, marker, _ in _CHAT_STYLES if marker in (chat_template or "")), None) or \
      next((s for s, _, need in _CHAT_STYLES if need <= self.tok2id.keys()), "generic")

  @classmethod
  def from_metadata(cls, md: dict[str, Any]) -> Tokenizer:
    g = lambda k: md.get(f"tokenizer.ggml.{k}")
    if g("model") != "gpt2":
      raise ValueError(f"unsupported tokenizer.ggml.model {g('model')!r}: only 'gpt2' (byte-level BPE) is supported")
    tokens, stop = list(g("tokens")), {g("eot_token_id"), g("eom_token_id")} - {None}
    return cls(tokens, list(g("token_type") or [NORMAL] * len(tokens)), list(g("merges") or []), g("pre") or "default",
               g("bos_token_id"), g("eos_token_id"), bool(g("add_bos_token")), stop, md.get("tokenizer.chat_template"))

  @property
  def vocab_size(self) -> int: return len(self.tokens)

  # *** encode ***

  def pretokenize(self, text: str) -> list[str]:
    spans, shadows = [(0, len(text))], {}
    for pat, collapsed in self.regexes:
      if collapsed not in shadows: shadows[collapsed] = text.translate(_COLLAPSE if collapsed else _WS_ONLY)
      shadow, out = shadows[collapsed], []
      for s, e in spans:
        for m in pat.finditer(shadow, s, e):
          if m.start() > s: out.append((s, m.start()))
          out.append(m.span())
          s = m.end()
        if s < e: out.append((s, e))
      spans = out
    return [text[s:e] for s, e in spans]

  def _bpe(self, word: str) -> list[str]:
    """Merge the lowest-rank adjacent pair (leftmost on ties) until none is left, like llama.cpp's bigram queue."""
    syms, heap = list(word), []
    nxt, prv = [*range(1, len(word)), -1], list(range(-1, len(word) - 1))
    def push(a: int, b: int):
      if a >= 0 and b >= 0 and (r := self.ranks.get(f"{syms[a]} {syms[b]}")) is not None:
        heapq.heappush(heap, (r, a, b, syms[a] + syms[b]))
    for i in range(len(word) - 1): push(i, i + 1)
    while heap:
      _, a, b, text = heapq.heappop(heap)
      if not syms[a] or not syms[b] or syms[a] + syms[b] != text: continue  # stale pair
      syms[a], syms[b], nxt[a] = text, "", nxt[b]
      if nxt[b] >= 0: prv[nxt[b]] = a
      push(prv[a], a); push(a, nxt[a])
    return [s for s in syms if s]

  def _word(self, word: str) -> list[int]:
    if (ids := self.cache.get(word)) is not None: return ids
    enc, t2i = _byte_encode(word), self.tok2id
    if self.ignore_merges and enc in t2i: ids = [t2i[enc]]
    else: ids = [i for s in self._bpe(enc) for i in ([t2i[s]] if s in t2i else [t2i[c] for c in s if c in t2i])]
    if len(self.cache) > 100_000: self.cache.clear()
    self.cache[word] = ids
    return ids

  def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
    """Special tokens written in the text become single tokens (user-defined ones even with parse_special=False).
    BOS is prepended when asked (default: tokenizer.ggml.add_bos_token) unless the text already starts with it."""
    frags: list[str | int] = [text] if text else []
    for t, i in self.specials if parse_special else self.user_defined:
      if any(isinstance(f, str) and t in f for f in frags): frags = [p for f in frags for p in _cut(f, t, i)]
    ids: list[int] = []
    for f in frags: ids += [f] if isinstance(f, int) else [i for w in self.pretokenize(f) for i in self._word(w)]
    if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None and ids[:1] != [self.bos_id]:
      ids.insert(0, self.bos_id)
    return ids

  # *** decode ***

  def _piece(self, i: int) -> bytes:
    """Bytes of one token as llama.cpp's token_to_piece(special=True) renders them."""
    if (p := self.pieces.get(i)) is not None: return p
    text, ty = self.tokens[i], self.types[i]
    if ty == NORMAL and i not in self.stop_ids: p = _byte_decode(text)
    elif ty in (NORMAL, CONTROL, UNKNOWN, USER_DEFINED): p = text.encode()
    else: p = bytes([int(text[3:5], 16)]) if ty == BYTE and text.startswith("<0x") else b""
    self.pieces[i] = p
    return p

  def decode_bytes(self, ids: list[int], special: bool = False) -> bytes:
    return b"".join(self._piece(i) for i in ids if special or i not in self.hidden)

  def decode(self, ids: list[int], special: bool = False) -> str:
    return self.decode_bytes(ids, special).decode("utf-8", "replace")

  def streamer(self, special: bool = False) -> StreamDecoder: return StreamDecoder(self, special)

  # *** chat ***

  def format_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Render with the model's own chat format: a jinja-free rendition of its template, picked from the special tokens
    in the vocab."""
    bos, eos = (self.tokens[i] if i is not None else "" for i in (self.bos_id, self.eos_id))
    prefix, fmt, gen = {  # role -> (before, after) content
      "glm": ("[gMASK]<sop>",
              {"system": ("<|system|>", ""), "user": ("<|user|>", ""), "assistant": ("<|assistant|></think>", "")},
              "<|assistant|><think>"),
      "deepseek3": (bos, {"system": ("", ""), "user": ("<｜User｜>", ""), "assistant": ("<｜Assistant｜>", eos)},
                    "<｜Assistant｜>"),
      "youtu": (bos, {"system": ("", ""), "user": ("<|User|>", ""), "assistant": ("<|Assistant|>", eos)},
                "<|Assistant|>"),
      "deepseek2": (bos, {"system": ("", "\n\n"), "user": ("User: ", "\n\n"), "assistant": ("Assistant: ", eos)},
                    "Assistant:"),
      "generic": ("", {"system": ("", "\n\n"), "user": ("User: ", "\n\n"), "assistant": ("Assistant: ", "\n\n")},
                  "Assistant:"),
    }[self.chat_style]
    out = prefix
    for m in messages:
      if m["role"] not in fmt: raise ValueError(f"unsupported chat role {m['role']!r}")
      content = m["content"].strip() if self.chat_style == "glm" and m["role"] == "assistant" else m["content"]
      out += fmt[m["role"]][0] + content + fmt[m["role"]][1]
    return out + (gen if add_generation_prompt else "")

class StreamDecoder:
  """Incremental detokenizer: feed token ids as they are sampled, get back only complete UTF-8 text."""
  def __init__(self, tok: Tokenizer, special: bool = False):
    self.tok, self.special, self.utf8 = tok, special, codecs.getincrementaldecoder("utf-8")("replace")
  def feed(self, ids: int | list[int]) -> str:
    return self.utf8.decode(self.tok.decode_bytes([ids] if isinstance(ids, int) else ids, self.special))
  def flush(self) -> str: return self.utf8.decode(b"", final=True)
