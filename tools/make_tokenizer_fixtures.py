#!/usr/bin/env python3
"""Builds small tokenizers and their reference token ids for troupe's tests.

Run with the pip Python (needs `tokenizers`, `gguf`, `jinja2`; optionally
`llama-cpp-python` for llama.cpp's ids of the GGUF vocabularies):
    python3 tools/make_tokenizer_fixtures.py            # fixtures
    python3 tools/make_tokenizer_fixtures.py --tables   # models/tokenizer_unicode_tables.cpp
CI does not run this; its outputs are committed under tests/fixtures/tokenizers/.
The committed llama.cpp ids came from llama-cpp-python 0.3.36 (its bundled
llama.cpp built from the PyPI sdist; LLAMA_CPP_LIB_PATH may point at the
built libllama.so). Training is not bit-reproducible across runs (BpeTrainer
tie order), so regenerate all files together.

No tokenizer can be downloaded here, so each one is trained with the
`tokenizers` library on the committed corpus.txt, in the layout of a real
model family:
  llama3_bpe  byte-level BPE, LLaMA-3 Split regex + ByteLevel(use_regex=False),
              ignore_merges, <|begin_of_text|> template, pair merges
  gpt2_bpe    byte-level BPE, ByteLevel pre-tokenizer with its GPT-2 regex,
              string merges ("a b"), <mask> with lstrip
  gpt2_prefix the same vocabulary with ByteLevel(add_prefix_space=True)
  qwen2_bpe   byte-level BPE, Qwen2 Split regex (single digits), NFC normalizer
  spm_bpe     SentencePiece-style BPE (LLaMA-2 / TinyLlama tokenizer.json):
              Prepend+Replace normalizer, byte_fallback, <0xNN> tokens,
              Replace/ByteFallback/Fuse/Strip decoder
  spm_meta    the same model with a Metaspace pre-tokenizer (prepend "first", no split)
  spm_meta_split  ... Metaspace prepend "always", split on "▁" (older LLaMA files)
and GGUF files of spm_bpe ("llama", scores) and llama3_bpe ("gpt2", merges).
"""
import json
import os
import sys
import unicodedata

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizers")

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The strings every tokenizer is checked on.
TRICKY = [
    "",
    " ",
    "  ",
    "hello",
    "Hello world",
    " Hello world",
    "Hello world ",
    "  leading and trailing  ",
    "multiple    spaces   between",
    "tab\tseparated\t\tvalues",
    "line one\nline two\n\nline four\n",
    "\n\n\n",
    "windows\r\nline\r\nends",
    " \n \n  x",
    "trailing newline and spaces \n   ",
    "1234567",
    "3.14159",
    "pi is 3.14159 and e is 2.71828, 1,000,000 people",
    "-273.15 and 10^9+7=1000000007",
    "Café naïve résumé jalapeño Zürich",
    "e\u0301 decomposed accent",
    "中文：你好，世界！",
    "日本語のテキスト、カタカナ。",
    "안녕하세요",
    "Привет, мир!",
    "مرحبا بالعالم",
    "😀 emoji 🎉🚀",
    "family 👨‍👩‍👧‍👦 and flag 🇫🇷 and 👍🏽",
    "rainbow 🏳️‍🌈!",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math letters 𝒳",
    "lone 龘 and 𠜎 and ☃",
    "हिन्दी नमस्ते",
    "phone 0123456789 and 9876543210",
    "def f(x):\n    return x * 2  # double\n",
    'int main() { printf("%d\\n", 42); }',
    "    indented code\n\tand tab",
    "don't won't I'm you're we've they'll she'd IT'S DON'T",
    "it'ſ a long s",
    "<|begin_of_text|>Hello<|eot_id|>",
    "text <|eot_id|> more <|eot_id|><|eot_id|>",
    "<s>hello</s> <unk> [INST] hi [/INST]",
    "<|endoftext|>after end<|endoftext|>",
    "mask: <mask> here  <mask>x",
    "[NOTE] a note [NOTE]",
    "<|not_a_token|> <|eot_id",
    "https://example.com/path?query=1&x=2#frag",
    "!!!!!! ?????? .......",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "CamelCase snake_case SCREAMING_SNAKE iPhone",
    "\u00a0non-breaking\u00a0space and\u3000ideographic space",
    "zero\u200bwidth and soft\u00adhyphen",
    "ends with space ",
    "▁already▁has▁metaspace",
    "<0x41> looks like a byte token",
    "The quick brown fox jumps over the lazy dog. The dog didn't care; it's a lazy dog, "
    "and they're all tired. Numbers 1234567, 3.14159 and 😀 中文 Café.\n\n    code();\n",
]


def corpus_lines():
    with open(os.path.join(OUT, "corpus.txt"), encoding="utf-8") as f:
        text = f.read()
    return [line for line in text.split("\n")]


def token_table(tok):
    """Model vocabulary plus added tokens, id -> string."""
    v = tok.get_vocab(with_added_tokens=True)
    return {i: s for s, i in v.items()}


def cases_for(tok, strings, special_names):
    out = []
    for s in strings:
        enc = tok.encode(s, add_special_tokens=False)
        enc_sp = tok.encode(s, add_special_tokens=True)
        tok.encode_special_tokens = True
        enc_raw = tok.encode(s, add_special_tokens=False)
        tok.encode_special_tokens = False
        out.append({
            "text": s,
            "ids": enc.ids,
            "ids_special": enc_sp.ids,
            "ids_no_parse_special": enc_raw.ids,
            "decoded": tok.decode(enc.ids, skip_special_tokens=False),
            "decoded_special": tok.decode(enc_sp.ids, skip_special_tokens=False),
            "decoded_skip": tok.decode(enc_sp.ids, skip_special_tokens=True),
        })
    return out


def train_byte_level(pre_tokenizer, specials, vocab_size, ignore_merges):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    tok.train_from_iterator(corpus_lines(), trainer)
    return tok


def make_llama3():
    from tokenizers import AddedToken, Regex, pre_tokenizers, processors

    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok = train_byte_level(pre, [], 1000, True)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.add_tokens([AddedToken("[NOTE]", special=False, normalized=False)])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", bos)]),
    ])
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": "llama3",
              "model_max_length": 131072}
    return tok, config


QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")


def make_qwen2():
    from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers

    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok = train_byte_level(pre, [], 900, False)
    tok.normalizer = normalizers.NFC()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]])
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "chat_template": CHAT_TEMPLATES["qwen2"]}
    return tok, config


def make_gpt2(add_prefix_space):
    from tokenizers import AddedToken, pre_tokenizers, processors

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = train_byte_level(pre, [], 800, False)
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False),
                            AddedToken("<mask>", special=True, lstrip=True, normalized=False)])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
              "add_bos_token": False}
    return tok, config


def spm_model():
    """Trains a SentencePiece-layout BPE; returns (vocab, merges)."""
    from tokenizers import Tokenizer, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=760, limit_alphabet=120, initial_alphabet=["▁"], show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(corpus_lines(), trainer)
    model = json.loads(tok.to_str())["model"]
    trained = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for s, _ in trained:
        if s not in vocab:
            vocab[s] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return vocab, merges


def make_spm(vocab, merges, metaspace, split=False):
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if metaspace:
        scheme = "always" if split else "first"
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=split)
        tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme=scheme, split=split),
                                         decoders.ByteFallback(), decoders.Fuse()])
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in ["<unk>", "<s>", "</s>"]])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
              "add_eos_token": False, "legacy": True}
    return tok, config


def write_tokenizer(name, tok, config, string_merges=False):
    """Saves tok (optionally with merges as "a b" strings, the older layout)
    and returns the tokenizer loaded back from the file, the reference."""
    from tokenizers import Tokenizer

    path = os.path.join(OUT, name + ".tokenizer.json")
    tok.save(path, pretty=False)
    if string_merges:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        doc["model"]["merges"] = [" ".join(m) for m in doc["model"]["merges"]]
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False, separators=(",", ":"))
    if config is not None:
        with open(os.path.join(OUT, name + ".tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False)
    return Tokenizer.from_file(path)


def write_cases(name, tok, extra=None):
    doc = {"tokenizer": name + ".tokenizer.json", "vocab_size": tok.get_vocab_size(with_added_tokens=True),
           "cases": cases_for(tok, TRICKY, [])}
    if extra:
        doc.update(extra)
    with open(os.path.join(OUT, name + ".cases.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=0)


def gguf_base(path):
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    return w


def write_gguf(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_spm(vocab, merges):
    """The spm_bpe vocabulary as a GGUF "llama" (SentencePiece) tokenizer.

    Scores follow SentencePiece BPE: a piece made by merge number k scores -k,
    so llama.cpp's highest-score-first merging replays the merge order."""
    import gguf

    tokens = sorted(vocab, key=lambda s: vocab[s])
    merged_rank = {}
    for k, (a, b) in enumerate(merges):
        merged_rank.setdefault(a + b, k)
    scores, types = [], []
    for s in tokens:
        if s == "<unk>":
            types.append(gguf.TokenType.UNKNOWN)
        elif s in ("<s>", "</s>"):
            types.append(gguf.TokenType.CONTROL)
        elif s.startswith("<0x") and len(s) == 6:
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
        scores.append(float(-merged_rank[s]) if s in merged_rank else 0.0)
    path = os.path.join(OUT, "spm_bpe.gguf")
    w = gguf_base(path)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    write_gguf(w)
    return path


def gguf_bpe(tok):
    """The llama3_bpe vocabulary as a GGUF "gpt2" tokenizer (pre "llama-bpe")."""
    import gguf

    doc = json.loads(tok.to_str())
    table = token_table(tok)
    tokens = [table[i] for i in range(len(table))]
    added = {t["content"]: t for t in doc["added_tokens"]}
    types = []
    for s in tokens:
        if s in added:
            types.append(gguf.TokenType.CONTROL if added[s]["special"] else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    merges = [" ".join(m) if isinstance(m, list) else m for m in doc["model"]["merges"]]
    path = os.path.join(OUT, "llama3_bpe.gguf")
    w = gguf_base(path)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.token_to_id("<|begin_of_text|>"))
    w.add_eos_token_id(tok.token_to_id("<|eot_id|>"))
    w.add_add_bos_token(True)
    write_gguf(w)
    return path


def llama_cpp_ids(path):
    """llama.cpp's own ids for the GGUF vocabulary, when llama-cpp-python is installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    out = []
    for s in TRICKY:
        b = s.encode("utf-8")
        out.append({
            "text": s,
            "ids": llm.tokenize(b, add_bos=False, special=True),
            "ids_special": llm.tokenize(b, add_bos=True, special=True),
            "ids_no_parse_special": llm.tokenize(b, add_bos=False, special=False),
            "decoded": llm.detokenize(llm.tokenize(b, add_bos=False, special=True)).decode("utf-8", "replace"),
        })
    return out


# Chat templates as published in the models' tokenizer_config.json / chat_template.json
# (LLaMA-2-chat, Meta-Llama-3-Instruct, ChatML, Qwen2 ChatML with a default system
# prompt, llava-1.5-hf, Gemma 3 -it, Mistral-7B-Instruct v0.3 and v0.1/v0.2, Phi-3.5-mini
# and the first Phi-3-mini), rendered with jinja2 the way transformers renders them.
CHAT_TEMPLATES = {
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
        "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
        "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if loop.index0 == 0 and system_message != false %}"
        "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
        "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
        "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
        "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"),
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ "
        "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
        "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    "chatml": (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
        " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "qwen2": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "llava": (
        "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
        "{% endif %}{# Render all images first #}{% for content in message['content'] | "
        "selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}{# Render all text next #}"
        "{% if message['role'] != 'assistant' %}{% for content in message['content'] | "
        "selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}{% endfor %}{% else %}"
        "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{% generation %}"
        "{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"),
    "gemma": (
        "{{ bos_token }}\n"
        "{%- if messages[0]['role'] == 'system' -%}\n"
        "    {%- if messages[0]['content'] is string -%}\n"
        "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
        "    {%- else -%}\n"
        "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
        "    {%- endif -%}\n"
        "    {%- set loop_messages = messages[1:] -%}\n"
        "{%- else -%}\n"
        "    {%- set first_user_prefix = \"\" -%}\n"
        "    {%- set loop_messages = messages -%}\n"
        "{%- endif -%}\n"
        "{%- for message in loop_messages -%}\n"
        "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
        "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
        "    {%- endif -%}\n"
        "    {%- if (message['role'] == 'assistant') -%}\n"
        "        {%- set role = \"model\" -%}\n"
        "    {%- else -%}\n"
        "        {%- set role = message['role'] -%}\n"
        "    {%- endif -%}\n"
        "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
        "    {%- if message['content'] is string -%}\n"
        "        {{ message['content'] | trim }}\n"
        "    {%- elif message['content'] is iterable -%}\n"
        "        {%- for item in message['content'] -%}\n"
        "            {%- if item['type'] == 'image' -%}\n"
        "                {{ '<start_of_image>' }}\n"
        "            {%- elif item['type'] == 'text' -%}\n"
        "                {{ item['text'] | trim }}\n"
        "            {%- endif -%}\n"
        "        {%- endfor -%}\n"
        "    {%- else -%}\n"
        "        {{ raise_exception(\"Invalid content type\") }}\n"
        "    {%- endif -%}\n"
        "    {{ '<end_of_turn>\\n' }}\n"
        "{%- endfor -%}\n"
        "{%- if add_generation_prompt -%}\n"
        "    {{'<start_of_turn>model\\n'}}\n"
        "{%- endif -%}\n"),
    # mistralai/Mistral-7B-Instruct-v0.3 (the system message goes into the last user turn)
    "mistral": r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
""",
    # mistralai/Mistral-7B-Instruct-v0.1 and v0.2
    "mistral-v1": (
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
        "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
        "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
        "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
        "roles are supported!') }}{% endif %}{% endfor %}"),
    # microsoft/Phi-3.5-mini-instruct
    "phi3": (
        "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
        "{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}"
        "{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'assistant' %}"
        "{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"),
    # microsoft/Phi-3-mini-4k-instruct as first published (2024-04): no system role
    "phi3-2024-04": (
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') %}"
        "{{'<|user|>' + '\\n' + message['content'] + '<|end|>' + '\\n' + '<|assistant|>' + '\\n'}}"
        "{% elif (message['role'] == 'assistant') %}{{message['content'] + '<|end|>' + '\\n'}}"
        "{% endif %}{% endfor %}"),
}


def _m(role, text, images=0):
    return {"role": role, "content": text, "images": images}


CHAT_CONVERSATIONS = [
    [_m("user", "Hello!")],
    [_m("system", "You are terse."), _m("user", "What is 2+2?")],
    [_m("system", "Be kind."), _m("user", "  Hi there \n"), _m("assistant", " Hello! How can I help? "),
     _m("user", "Tell me a joke.")],
    [_m("user", "Line one\nLine two"), _m("assistant", "Sure."), _m("user", "Thanks")],
    [_m("user", "Describe this.", 1)],
    [_m("user", "Compare these two pictures.", 2), _m("assistant", "They differ."), _m("user", "How?")],
    [_m("system", "Be brief."), _m("user", "Hi"), _m("assistant", " Hello. ")],
    [_m("system", ""), _m("user", "Hi")],
    [_m("user", "a"), _m("system", "mid"), _m("user", "b")],
]


def render_chat_transformers(template, conversation, add_generation_prompt, bos, eos, name):
    """What tokenizer.apply_chat_template renders (transformers' own
    render_jinja_template, which apply_chat_template calls); None where the
    template raises or the format has no image parts."""
    import jinja2
    from transformers.utils.chat_template_utils import render_jinja_template
    if name == "llava":
        msgs = [{"role": m["role"], "content": [{"type": "image"}] * m["images"] +
                 [{"type": "text", "text": m["content"]}]} for m in conversation]
    else:
        if any(m["images"] for m in conversation):
            return None
        msgs = [{"role": m["role"], "content": m["content"]} for m in conversation]
    try:
        out = render_jinja_template(conversations=[msgs], chat_template=template,
                                    add_generation_prompt=add_generation_prompt,
                                    bos_token=bos, eos_token=eos)
    except (jinja2.exceptions.TemplateError, ValueError):
        return None
    rendered = out[0] if isinstance(out, tuple) else out
    return rendered[0] if isinstance(rendered, list) else rendered


def render_chat(template, conversation, add_generation_prompt, bos, eos, name):
    """transformers' rendering where transformers is installed, else the same
    jinja2 environment (sandboxed, trim_blocks, lstrip_blocks, loopcontrols,
    {% generation %}) built here."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return render_chat_jinja(template, conversation, add_generation_prompt, bos, eos, name)
    return render_chat_transformers(template, conversation, add_generation_prompt, bos, eos, name)


def render_chat_jinja(template, conversation, add_generation_prompt, bos, eos, name):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # transformers' {% generation %} block, rendered as its body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    if name == "llava":
        msgs = [{"role": m["role"], "content": [{"type": "image"}] * m["images"] + [{"type": "text", "text": m["content"]}]}
                for m in conversation]
    else:
        if any(m["images"] for m in conversation):
            return None
        msgs = [{"role": m["role"], "content": m["content"]} for m in conversation]
    try:
        return env.from_string(template).render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                                bos_token=bos, eos_token=eos)
    except jinja2.exceptions.TemplateError:
        return None


def make_chat_fixtures():
    tokens = {"llama2": ("<s>", "</s>"), "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
              "chatml": ("", "<|im_end|>"), "qwen2": ("", "<|im_end|>"), "llava": ("<s>", "</s>"),
              "gemma": ("<bos>", "<eos>"), "mistral": ("<s>", "</s>"), "mistral-v1": ("<s>", "</s>"),
              "phi3": ("<s>", "<|endoftext|>"), "phi3-2024-04": ("<s>", "<|endoftext|>")}
    doc = {"templates": CHAT_TEMPLATES, "cases": []}
    for name, template in CHAT_TEMPLATES.items():
        bos, eos = tokens[name]
        for conv in CHAT_CONVERSATIONS:
            for gen in (False, True):
                out = render_chat(template, conv, gen, bos, eos, name)
                # None: the template refuses the conversation (roles, images)
                doc["cases"].append({"template": name, "messages": conv, "add_generation_prompt": gen,
                                     "bos_token": bos, "eos_token": eos, "expected": out})
    with open(os.path.join(OUT, "chat_templates.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)


def make_tables():
    """Range tables of \\p{L} and \\p{N} (Python's unicodedata) for the splitter."""
    def ranges(pred):
        out, start = [], None
        for cp in range(0x110000):
            ok = pred(unicodedata.category(chr(cp)))
            if ok and start is None:
                start = cp
            if not ok and start is not None:
                out.append((start, cp - 1))
                start = None
        if start is not None:
            out.append((start, 0x10FFFF))
        return out

    def emit(name, rs):
        lines = ["const codepoint_range %s[] = {" % name]
        for i in range(0, len(rs), 6):
            lines.append("    " + " ".join("{0x%X, 0x%X}," % r for r in rs[i:i + 6]))
        lines.append("};")
        return "\n".join(lines)

    letters = ranges(lambda c: c[0] == "L")
    numbers = ranges(lambda c: c[0] == "N")
    # Code points NFC can change or move: non-zero combining class, not
    # their own NFC form, or the second half of a canonical composition
    # (incl. Hangul V and T jamo). Text without any of them is already NFC.
    seconds = set(range(0x1161, 0x1176)) | set(range(0x11A8, 0x11C3))
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        d = unicodedata.decomposition(chr(cp))
        if d and not d.startswith("<"):
            parts = d.split()
            if len(parts) == 2 and unicodedata.normalize("NFC", chr(int(parts[0], 16)) + chr(int(parts[1], 16))) == chr(cp):
                seconds.add(int(parts[1], 16))

    def nfc_unstable(cp):
        if 0xD800 <= cp <= 0xDFFF:
            return False
        c = chr(cp)
        return unicodedata.combining(c) != 0 or unicodedata.normalize("NFC", c) != c or cp in seconds

    unstable, start = [], None
    for cp in range(0x110001):
        u = cp < 0x110000 and nfc_unstable(cp)
        if u and start is None:
            start = cp
        if not u and start is not None:
            unstable.append((start, cp - 1))
            start = None
    text = ("// Generated by tools/make_tokenizer_fixtures.py --tables from Python's unicodedata\n"
            "// (Unicode %s): the code point ranges of the general categories L* and N*,\n"
            "// and of the code points that NFC normalization may change.\n"
            "#include \"models/tokenizer_unicode.hpp\"\n\nnamespace troupe::models::unicode {\n\nnamespace {\n\n"
            "%s\n\n%s\n\n%s\n\n"
            "bool in_ranges(const codepoint_range* r, std::size_t n, char32_t cp) {\n"
            "  std::size_t lo = 0, hi = n;\n"
            "  while (lo < hi) {\n"
            "    const std::size_t mid = (lo + hi) / 2;\n"
            "    if (cp < r[mid].first) hi = mid;\n"
            "    else if (cp > r[mid].last) lo = mid + 1;\n"
            "    else return true;\n"
            "  }\n"
            "  return false;\n"
            "}\n\n}  // namespace\n\n"
            "bool is_letter(char32_t cp) { return in_ranges(letter_ranges, std::size(letter_ranges), cp); }\n"
            "bool is_number(char32_t cp) { return in_ranges(number_ranges, std::size(number_ranges), cp); }\n"
            "bool may_change_under_nfc(char32_t cp) {\n"
            "  return in_ranges(nfc_unstable_ranges, std::size(nfc_unstable_ranges), cp);\n}\n\n"
            "}  // namespace troupe::models::unicode\n") % (unicodedata.unidata_version,
                                                            emit("letter_ranges", letters),
                                                            emit("number_ranges", numbers),
                                                            emit("nfc_unstable_ranges", unstable))
    with open(os.path.join(ROOT, "models", "tokenizer_unicode_tables.cpp"), "w") as f:
        f.write(text)


def main():
    if "--chat" in sys.argv:
        make_chat_fixtures()
        return
    if "--tables" in sys.argv:
        make_tables()
        return
    os.makedirs(OUT, exist_ok=True)
    tok, cfg = make_llama3()
    tok = write_tokenizer("llama3_bpe", tok, cfg)
    write_cases("llama3_bpe", tok)
    bpe_gguf = gguf_bpe(tok)
    ref = llama_cpp_ids(bpe_gguf)
    with open(os.path.join(OUT, "llama3_bpe.gguf.cases.json"), "w", encoding="utf-8") as f:
        json.dump({"gguf": "llama3_bpe.gguf", "llama_cpp": ref}, f, ensure_ascii=False, indent=0)

    tok, cfg = make_qwen2()
    tok = write_tokenizer("qwen2_bpe", tok, cfg)
    write_cases("qwen2_bpe", tok)

    for name, prefix in (("gpt2_bpe", False), ("gpt2_prefix", True)):
        tok, cfg = make_gpt2(prefix)
        tok = write_tokenizer(name, tok, cfg, string_merges=True)
        write_cases(name, tok)

    vocab, merges = spm_model()
    for name, meta, split in (("spm_bpe", False, False), ("spm_meta", True, False), ("spm_meta_split", True, True)):
        tok, cfg = make_spm(vocab, merges, meta, split)
        tok = write_tokenizer(name, tok, cfg)
        write_cases(name, tok)
    spm_gguf = gguf_spm(vocab, merges)
    ref = llama_cpp_ids(spm_gguf)
    with open(os.path.join(OUT, "spm_bpe.gguf.cases.json"), "w", encoding="utf-8") as f:
        json.dump({"gguf": "spm_bpe.gguf", "llama_cpp": ref}, f, ensure_ascii=False, indent=0)

    make_chat_fixtures()
    make_utf8_fixtures()


def make_utf8_fixtures():
    """Python's UTF-8 decoding with errors="replace" (one U+FFFD per maximal
    invalid subpart, as Rust's from_utf8_lossy) for byte strings."""
    samples = ["", "41", "c3a9", "e282ac", "f09f9880", "e282", "f09f98", "c3", "80", "bf41", "c0af", "e080af",
               "eda080", "f4908080", "f880808080", "fe", "ff41", "e2824141", "f09f41", "c328", "41e2", "41f09f98",
               "e282ace282", "f0808080", "c3a9e2", "ed9fbf", "eeb080"]
    doc = [{"hex": h, "text": bytes.fromhex(h).decode("utf-8", "replace"),
            "valid": _valid(bytes.fromhex(h))} for h in samples]
    with open(os.path.join(OUT, "utf8_lossy.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=0)


def _valid(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


if __name__ == "__main__":
    main()
