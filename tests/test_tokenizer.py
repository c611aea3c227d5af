import collections
import random
import re
import time

import gguf
import pytest

from model.tokenizer import PRE_TOKENIZERS, Tokenizer

CORPUS = """The quick brown fox jumps over the lazy dog while the other dogs sleep in the warm afternoon sun. It's a simple test:
we're sure they'll say it didn't work, but I've seen the results and they are good. Numbers like 12345678, 3.14159 and
1,000,000 appear in the text, as do words such as tokenizer, tokenization, token, encode, decode and decoder.
def hello_world(x: int) -> int:
    return x * 12345 + 678  # comment

\tprint("hello, world")
Café naïve résumé façade – “quotes” and ‘apostrophes’… 東京は日本の首都です。中文测试，你好！한국어 텍스트 😀🚀
"""  # noqa: E501 - the text the tests tokenize, as written
CONTROL = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
           "</think>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
# whole words that merges can't build: only pre types with ignore_merges emit them
EXTRA = ["Ġextraordinary", "987", "ĉĉ"]
TEXTS = [
  "Hello world", "The quick brown fox jumps over the lazy dog.", "I'm sure they'll say it's fine; we'VE DON'T 'tis",
  "12345678 and 3.14159, 1,000,000 ٣٤٥ ²½ x2y33z444", "def f(x):\n    return x**2  # square\n\n\tpass\r\n",
  "   leading and trailing   ", "tabs\t\tand\n\n\nnewlines \n \n", "Café naïve résumé façade Ærøskøbing",
  "e\u0301 combining, ǅungla Ǉ title, µ ß ﬁ \u212aelvin \u2126hm \u1f7d\u1fbe",
  "東京は日本の首都です。中文测试，你好！", "한국어 텍스트 ㄱㄴ ㄅㄆ", "emoji 😀🚀👍🏽 mixed😀text",
  "fullwidth ＡＢＣ！？ and “quotes” ‘single’ — dash… ellipsis",
  "nbsp\u00a0here and\u3000ideographic\u2003em space", "HelloWorld camelCase XMLHttpRequest",
  "path/to/file.txt https://example.com/a?b=c&d=e", "Greek αβγ Ωmega Кириллица עברית العربية",
  "<|user|>hi<|assistant|>there<|endoftext|>", "<|user|><|user|> <|user|>",
  "[gMASK]<sop><|system|>sys<think>ok</think><tool_call>x", " ", "\n", "a" * 50 + " " * 20 + "!!!???",
  "extraordinary 987 unbelievable \t\t ", "x\u200by zero-width, \x01 control",
]
FUZZ_ALPHABET = [*"aZ09 '\t\n\r.,!?-_/\\\"()[]{}<>$+=^~|`@#%&*;:éÆßµǅΩКж東京한국ㄱㄅ가。，！？“”‘’—…、",
                 "\u3000", "\u00a0", "\u2003", "\u200b", "\u0301", "٣", "²", "½", "Ⅻ", "Ａ", "０", "😀", "👍🏽",
                 "\u212a", "\u1f7d", "<|user|>", "<tool_call>", "'s", "'LL", "123456"]

def bytes_to_unicode() -> dict[int, str]:
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
  cs, n = bs[:], 0
  for b in range(256):
    if b not in bs: bs.append(b); cs.append(256 + n); n += 1
  return dict(zip(bs, map(chr, cs), strict=True))

B2U = bytes_to_unicode()

def train_merges(text: str, n: int) -> list[str]:
  """Tiny deterministic BPE: merge the most frequent adjacent pair (ties: smallest pair) n times."""
  words = collections.Counter("".join(B2U[b] for b in w.encode()) for w in re.findall(r" ?\w+| ?[^\w\s]+|\s+", text))
  seqs, merges = {w: list(w) for w in words}, []
  for _ in range(n):
    pairs = collections.Counter()
    for w, c in words.items():
      for p in zip(seqs[w], seqs[w][1:], strict=False): pairs[p] += c
    if not pairs: break
    a, b = min(pairs, key=lambda p: (-pairs[p], p))
    merges.append(f"{a} {b}")
    for w, s in seqs.items():
      out, i = [], 0
      while i < len(s):
        if s[i:i+2] == [a, b]: out.append(a + b); i += 2
        else: out.append(s[i]); i += 1
      seqs[w] = out
  return merges

MERGES = train_merges(CORPUS * 4, 400)

def make_md(pre: str = "glm4", control: list[str] = CONTROL, bos: str | None = "<｜begin▁of▁sentence｜>",
            eos: str | None = "<|endoftext|>", add_bos: bool = False) -> dict:
  tokens = list(B2U.values())
  tokens += list(dict.fromkeys(m.replace(" ", "") for m in MERGES if m.replace(" ", "") not in tokens)) + EXTRA
  types = [gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.USER_DEFINED] + [gguf.TokenType.CONTROL] * len(
    control)
  tokens += ["<tool_call>", *control]
  assert len(set(tokens)) == len(tokens)
  md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [int(t) for t in types], "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.add_bos_token": add_bos}
  if bos is not None: md["tokenizer.ggml.bos_token_id"] = tokens.index(bos)
  if eos is not None: md["tokenizer.ggml.eos_token_id"] = tokens.index(eos)
  return md

def write_gguf(path, md: dict):
  w = gguf.GGUFWriter(str(path), "deepseek2")
  for k, v in md.items():
    if isinstance(v, bool): w.add_bool(k, v)
    elif isinstance(v, int): w.add_uint32(k, v)
    elif isinstance(v, str): w.add_string(k, v)
    else: w.add_array(k, v)
  w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

LLAMA_PRES = [p for p in PRE_TOKENIZERS if p != "gpt2"]  # "gpt2" is our alias of llama.cpp's "gpt-2"

@pytest.fixture(scope="module")
def llama_vocab(tmp_path_factory):
  llama_cpp = pytest.importorskip("llama_cpp")
  cache = {}
  def get(pre: str):
    if pre not in cache:
      write_gguf(path := tmp_path_factory.mktemp("vocab") / f"{pre}.gguf", make_md(pre))
      cache[pre] = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return cache[pre]
  return get

@pytest.mark.parametrize("pre", LLAMA_PRES)
def test_matches_llama_cpp(pre, llama_vocab):
  tok, ref, rng = Tokenizer.from_metadata(make_md(pre)), llama_vocab(pre), random.Random(pre)
  fuzz = ["".join(rng.choices(FUZZ_ALPHABET, k=rng.randint(1, 24))) for _ in range(100)]
  for s in TEXTS + [CORPUS] + fuzz:
    ids = tok.encode(s, add_bos=False)
    assert ids == ref.tokenize(s.encode(), add_bos=False, special=True), (pre, s)
    assert (tok.encode(s, add_bos=False, parse_special=False)
            == ref.tokenize(s.encode(), add_bos=False, special=False)), (pre, s)
    assert tok.decode_bytes(ids) == ref.detokenize(ids), (pre, s)
    assert tok.decode_bytes(ids, special=True) == ref.detokenize(ids, special=True), (pre, s)

@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_round_trip(pre):
  tok = Tokenizer.from_metadata(make_md(pre))
  for s in TEXTS:
    assert tok.decode(tok.encode(s), special=True) == s
    if "<" not in s: assert tok.decode(tok.encode(s)) == s

def test_special_tokens_and_ignore_merges():
  md = make_md("glm4")
  tok, ids = Tokenizer.from_metadata(md), {t: i for i, t in enumerate(md["tokenizer.ggml.tokens"])}
  assert tok.encode("<|user|>hi<|assistant|>")[::2] == [ids["<|user|>"], ids["<|assistant|>"]]
  assert ids["<|user|>"] not in tok.encode("<|user|>", parse_special=False)
  assert tok.encode("<tool_call>", parse_special=False) == [ids["<tool_call>"]]
  assert tok.decode(tok.encode("<|user|>hi<tool_call>")) == "hi<tool_call>"
  assert tok.encode(" extraordinary") == [ids["Ġextraordinary"]]
  assert len(Tokenizer.from_metadata(make_md("deepseek-llm")).encode(" extraordinary")) > 1
  assert tok.encode("gpt2 alias") == Tokenizer.from_metadata(make_md("gpt-2")).encode("gpt2 alias")

def test_bos_stop_ids_and_vocab():
  md = make_md("deepseek-llm", add_bos=True)
  tok, ids = Tokenizer.from_metadata(md), {t: i for i, t in enumerate(md["tokenizer.ggml.tokens"])}
  bos = ids["<｜begin▁of▁sentence｜>"]
  assert tok.bos_id == bos and tok.encode("hi")[0] == bos and tok.encode("hi", add_bos=False)[0] != bos
  assert tok.encode("<｜begin▁of▁sentence｜>hi")[:2] == [bos, tok.encode("hi", add_bos=False)[0]]  # no double BOS
  assert tok.vocab_size == len(md["tokenizer.ggml.tokens"])
  assert tok.stop_ids == {ids[t] for t in ("<|endoftext|>", "<|user|>", "<|observation|>", "<｜end▁of▁sentence｜>")}
  glm = Tokenizer.from_metadata({**make_md("glm4", bos="[gMASK]"), "tokenizer.ggml.eot_token_id": ids["</think>"]})
  assert ids["</think>"] in glm.stop_ids and glm.eos_id == ids["<|endoftext|>"]

def test_streaming_decode():
  tok = Tokenizer.from_metadata(make_md("youtu"))
  s = "héllo 東京 😀🚀 한국어<|user|>!"
  stream, ids = tok.streamer(), tok.encode(s)
  parts = [stream.feed(i) for i in ids] + [stream.flush()]
  assert "".join(parts) == s.replace("<|user|>", "") and "" in parts[:-1] and not any("\ufffd" in p for p in parts)

def test_long_prompt_is_fast():
  tok, text = Tokenizer.from_metadata(make_md("deepseek-llm")), (CORPUS + " ".join(TEXTS)) * 4
  t0 = time.perf_counter()
  ids = tok.encode(text, add_bos=False)
  assert tok.decode(ids, special=True) == text and time.perf_counter() - t0 < 2.0

MSGS = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": " Hello! "}, {"role": "user", "content": "How are you?"}]

@pytest.mark.parametrize("control,bos,eos,expected", [
  (["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"], "[gMASK]",
   "<|endoftext|>",
   "[gMASK]<sop><|system|>You are helpful.<|user|>Hi<|assistant|></think>Hello!<|user|>How are you?"
   "<|assistant|><think>"),
  (["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"], "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
   "<｜begin▁of▁sentence｜>You are helpful.\n\nUser: Hi\n\nAssistant:  Hello! <｜end▁of▁sentence｜>User: How are "
   "you?\n\nAssistant:"),
  (["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"], "<｜begin▁of▁sentence｜>",
   "<｜end▁of▁sentence｜>",
   "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Hi<｜Assistant｜> Hello! <｜end▁of▁sentence｜><｜User｜>How are "
   "you?<｜Assistant｜>"),
  (["<|begin_of_text|>", "<|end_of_text|>", "<|User|>", "<|Assistant|>"], "<|begin_of_text|>", "<|end_of_text|>",
   "<|begin_of_text|>You are helpful.<|User|>Hi<|Assistant|> Hello! <|end_of_text|><|User|>How are you?<|Assistant|>"),
  (["<|endoftext|>"], None, "<|endoftext|>",
   "You are helpful.\n\nUser: Hi\n\nAssistant:  Hello! \n\nUser: How are you?\n\nAssistant:"),
])
def test_format_chat(control, bos, eos, expected):
  tok = Tokenizer.from_metadata(make_md("glm4", control=control, bos=bos, eos=eos, add_bos=bos is not None))
  assert tok.format_chat(MSGS) == expected
  assert expected.startswith(no_gen := tok.format_chat(MSGS,
                                                       add_generation_prompt=False)) and len(no_gen) < len(expected)
  ids = tok.encode(tok.format_chat(MSGS))
  assert tok.decode(ids, special=True) == expected and (bos is None or ids.count(tok.bos_id) == 1)
  with pytest.raises(ValueError, match="role"): tok.format_chat([{"role": "robot", "content": "x"}])

def test_chat_style_detection():
  # ASCII-pipe turn tokens must not make it youtu
  ds2_vocab = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<|User|>", "<|Assistant|>"]
  assert Tokenizer.from_metadata(make_md(control=ds2_vocab, eos="<｜end▁of▁sentence｜>")).chat_style == "deepseek2"
  ds3_vocab = make_md(control=[*ds2_vocab, "<｜User｜>", "<｜Assistant｜>"], eos="<｜end▁of▁sentence｜>")
  assert Tokenizer.from_metadata(ds3_vocab).chat_style == "deepseek3"
  ds2_template = "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}"
  assert Tokenizer.from_metadata({**ds3_vocab, "tokenizer.chat_template": ds2_template}).chat_style == "deepseek2"
  assert Tokenizer.from_metadata(make_md(control=["<|endoftext|>"], bos=None)).chat_style == "generic"

def test_unsupported_metadata():
  with pytest.raises(ValueError, match="tokenizer.ggml.model"):
    Tokenizer.from_metadata({**make_md(), "tokenizer.ggml.model": "llama"})
  with pytest.raises(ValueError, match="tokenizer.ggml.pre"): Tokenizer.from_metadata(make_md("qwen2"))
  assert Tokenizer.from_metadata({k: v for k, v in make_md().items() if k != "tokenizer.ggml.pre"}).pre == "default"
