// Chat formatting: every format against its templates rendered by Jinja (tests/data/chat/expected.txt), ChatML's
// default system message, the templates the model files hold, and chat prompts tokenized with their vocabularies.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "cascade/error.hpp"
#include "model/chat.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"

namespace test_chat {

using cascade::apply_chat_template;
using cascade::ChatMessage;

namespace {

const std::string kModel = CASCADE_MODEL_PATH;

// The template as stored in SmolLM2-135M-Instruct (tokenizer.chat_template); the test below checks that the
// model file still holds exactly this text.
const std::string kSmolTemplate =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const std::string kSmolSystem =
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";

// A ChatML template with no default system message.
const std::string kPlainChatml =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

// Meta's Llama 3 Instruct template.
const std::string kLlama3 =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

}  // namespace

TEST_CASE("chat: the SmolLM2 file holds the template these tests use") {
  REQUIRE_MESSAGE(std::filesystem::exists(kModel), "missing model ", kModel, ": run scripts/setup.sh");
  const auto file = cascade::gguf::File::open(kModel);
  CHECK(std::string(file.get_string("tokenizer.chat_template")) == kSmolTemplate);
  CHECK(cascade::chatml_default_system(kSmolTemplate) ==
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
}

TEST_CASE("chat: ChatML with SmolLM2's default system message") {
  CHECK(cascade::detect_chat_format(kSmolTemplate) == cascade::ChatFormat::chatml);
  const std::vector<ChatMessage> user_only = {{"user", "What is 2+2?"}};
  CHECK(apply_chat_template(kSmolTemplate, user_only, true) ==
        kSmolSystem + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n");
  CHECK(apply_chat_template(kSmolTemplate, user_only, false) ==
        kSmolSystem + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n");

  // A system message of the caller's replaces the default one.
  const std::vector<ChatMessage> with_system = {
      {"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello!"}, {"user", "  spaces kept \n"}};
  CHECK(apply_chat_template(kSmolTemplate, with_system, true) ==
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\n  spaces kept \n<|im_end|>\n"
        "<|im_start|>assistant\n");

  // The template only looks at the first message: a later system message is an ordinary turn.
  const std::vector<ChatMessage> late_system = {{"user", "a"}, {"system", "b"}};
  CHECK(apply_chat_template(kSmolTemplate, late_system, false) ==
        kSmolSystem + "<|im_start|>user\na<|im_end|>\n<|im_start|>system\nb<|im_end|>\n");

  // No messages: the loop never runs, so only the generation prompt.
  CHECK(apply_chat_template(kSmolTemplate, {}, true) == "<|im_start|>assistant\n");
}

TEST_CASE("chat: ChatML without a default system message") {
  CHECK(cascade::chatml_default_system(kPlainChatml).empty());
  CHECK(apply_chat_template(kPlainChatml, {{"user", "Hi"}}, true) ==
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

TEST_CASE("chat: Llama 3") {
  CHECK(cascade::detect_chat_format(kLlama3) == cascade::ChatFormat::llama3);
  const std::vector<ChatMessage> msgs = {{"system", "You are terse."}, {"user", "  Hello there \n"}};
  CHECK(apply_chat_template(kLlama3, msgs, true) ==
        "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n");
  CHECK(apply_chat_template(kLlama3, {{"user", "x"}}, false) ==
        "<|start_header_id|>user<|end_header_id|>\n\nx<|eot_id|>");
}

TEST_CASE("chat: unknown templates ask for a raw prompt") {
  const std::string vicuna =
      "{% for message in messages %}{% if message['role'] == 'user' %}{{ 'USER: ' + message['content'] + '\n' }}"
      "{% else %}{{ 'ASSISTANT: ' + message['content'] + '</s>\n' }}{% endif %}{% endfor %}";
  const std::string mistral_v7 = "{{ '[SYSTEM_PROMPT]' + system + '[/SYSTEM_PROMPT][INST]' }}";
  for (const std::string& t : {vicuna, mistral_v7, std::string()}) {
    try {
      apply_chat_template(t, {{"user", "hi"}}, true);
      FAIL("no error for an unknown template");
    } catch (const cascade::Error& e) {
      CHECK(std::string(e.what()).find("without --chat") != std::string::npos);
    }
  }
}

TEST_CASE("chat: a SmolLM2 chat prompt tokenizes with its special tokens") {
  REQUIRE_MESSAGE(std::filesystem::exists(kModel), "missing model ", kModel, ": run scripts/setup.sh");
  const cascade::Tokenizer tok(cascade::load_vocab(cascade::gguf::File::open(kModel)));
  const std::string prompt = apply_chat_template(tok.vocab().chat_template, {{"user", "Hi"}}, true);
  const std::vector<int32_t> ids = tok.encode(prompt, true, /*parse_special=*/true);
  REQUIRE(ids.size() > 6);
  CHECK(ids.front() == 1);  // <|im_start|>
  const auto last_start = std::find(ids.rbegin(), ids.rend(), 1).base();  // just after the last <|im_start|>
  CHECK(tok.decode(std::vector<int32_t>(last_start, ids.end())) == "assistant\n");
  CHECK(std::count(ids.begin(), ids.end(), 2) == 2);  // <|im_end|> after system and user
  CHECK(tok.decode(ids) == prompt);
}

// --- every format against Jinja's rendering of its templates ---------------------------------------------------

namespace {

const std::string kChatData = CASCADE_TESTDATA_DIR "/chat/";

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  REQUIRE_MESSAGE(f.good(), "cannot read ", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct RenderedCase {
  std::string template_file;
  bool add_generation_prompt;
  std::vector<ChatMessage> msgs;
  std::string expected;
};

// expected.txt (tests/data/chat/render.py): "case FILE GEN N", then N times "message ROLE BYTES\nCONTENT\n", then
// "expect BYTES\nTEXT\n".
std::vector<RenderedCase> read_rendered(const std::string& path) {
  const std::string data = read_text(path);
  std::vector<RenderedCase> out;
  size_t pos = 0;
  const auto line = [&] {
    const size_t nl = data.find('\n', pos);
    REQUIRE_MESSAGE(nl != std::string::npos, path, ": truncated at byte ", pos);
    std::istringstream words(data.substr(pos, nl - pos));
    pos = nl + 1;
    return words;
  };
  const auto bytes = [&](size_t n) {
    const bool ends_line = pos + n < data.size() && data[pos + n] == '\n';
    REQUIRE_MESSAGE(ends_line, path, ": bad length at byte ", pos);
    std::string s = data.substr(pos, n);
    pos += n + 1;
    return s;
  };
  while (pos < data.size()) {
    RenderedCase c;
    std::string word;
    size_t n_msgs = 0;
    int gen = 0;
    line() >> word >> c.template_file >> gen >> n_msgs;
    REQUIRE(word == "case");
    c.add_generation_prompt = gen != 0;
    for (size_t k = 0; k < n_msgs; ++k) {
      ChatMessage m;
      size_t n = 0;
      line() >> word >> m.role >> n;
      REQUIRE(word == "message");
      m.content = bytes(n);
      c.msgs.push_back(std::move(m));
    }
    size_t n = 0;
    line() >> word >> n;
    REQUIRE(word == "expect");
    c.expected = bytes(n);
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace

TEST_CASE("chat: each format writes what its templates render (Jinja)") {
  const std::vector<RenderedCase> cases = read_rendered(kChatData + "expected.txt");
  std::map<std::string, int> n_pass, n_all;
  for (const RenderedCase& c : cases) {
    const std::string t = read_text(kChatData + c.template_file);
    const std::string got = apply_chat_template(t, c.msgs, c.add_generation_prompt);
    std::string conv;
    for (const ChatMessage& m : c.msgs) conv += "[" + m.role + ": " + m.content + "]";
    CHECK_MESSAGE(got == c.expected, c.template_file, " gen=", c.add_generation_prompt, " ", conv, "\n got:      '",
                  got, "'\n expected: '", c.expected, "'");
    n_pass[c.template_file] += got == c.expected;
    n_all[c.template_file] += 1;
  }
  for (const auto& [name, n] : n_all) MESSAGE(name, ": ", n_pass[name], "/", n, " conversations as Jinja renders them");
  // Every format is covered.
  std::map<cascade::ChatFormat, int> formats;
  for (const auto& [name, n] : n_all) formats[cascade::detect_chat_format(read_text(kChatData + name))] += n;
  CHECK(formats.size() == 5);
}

TEST_CASE("chat: the vocabularies' templates are the files the rendering used") {
  for (const auto& [vocab, file] : {std::pair<std::string, std::string>{"ggml-vocab-qwen2.gguf", "qwen2-vocab.jinja"},
                                    {"ggml-vocab-phi-3.gguf", "phi-3-vocab.jinja"}}) {
    const auto f = cascade::gguf::File::open(CASCADE_TESTDATA_DIR "/tokenizer/" + vocab);
    CHECK_MESSAGE(std::string(f.get_string("tokenizer.chat_template")) == read_text(kChatData + file), vocab);
  }
  CHECK(read_text(kChatData + "smollm2.jinja") == kSmolTemplate);
}

TEST_CASE("chat: the built-in names give their formats") {
  using cascade::ChatFormat;
  const std::vector<std::pair<std::string, ChatFormat>> names = {{"chatml", ChatFormat::chatml},
                                                                 {"llama3", ChatFormat::llama3},
                                                                 {"phi3", ChatFormat::phi3},
                                                                 {"gemma", ChatFormat::gemma},
                                                                 {"mistral", ChatFormat::mistral}};
  for (const auto& [name, format] : names) {
    CHECK_MESSAGE(cascade::detect_chat_format(cascade::builtin_chat_template(name)) == format, name);
  }
  CHECK(cascade::builtin_chat_template("vicuna").empty());
  // The built-in Phi-3 and Mistral write as Phi-3.5's and Mistral v0.3's templates do.
  const std::vector<ChatMessage> msgs = {{"system", "S"}, {"user", "U"}};
  CHECK(apply_chat_template(cascade::builtin_chat_template("phi3"), msgs, true) ==
        apply_chat_template(read_text(kChatData + "phi-3.5-mini-instruct.jinja"), msgs, true));
  CHECK(apply_chat_template(cascade::builtin_chat_template("mistral"), msgs, true) ==
        apply_chat_template(read_text(kChatData + "mistral-7b-instruct-v0.3.jinja"), msgs, true));
}

// A chat prompt of each vocabulary encodes its turn markers as single special tokens, and the token that closes
// a turn ends generation.
TEST_CASE("chat: prompts tokenize with each vocabulary's special tokens") {
  struct Vocab {
    std::string path, template_file, end_of_turn;
  };
  std::vector<Vocab> vocabs = {
      {CASCADE_TESTDATA_DIR "/tokenizer/ggml-vocab-qwen2.gguf", "qwen3.jinja", "<|im_end|>"},
      {CASCADE_TESTDATA_DIR "/tokenizer/ggml-vocab-phi-3.gguf", "phi-3.5-mini-instruct.jinja", "<|end|>"},
  };
  const std::string gemma = CASCADE_SOURCE_DIR "/models/gemma-3-270m-q4_k_m.gguf";
  if (std::filesystem::exists(gemma)) vocabs.push_back({gemma, "gemma-3-it.jinja", "<end_of_turn>"});
  for (const Vocab& v : vocabs) {
    CAPTURE(v.path);
    const cascade::Tokenizer tok(cascade::load_vocab(cascade::gguf::File::open(v.path)));
    const std::vector<ChatMessage> msgs = {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello!"},
                                           {"user", "Bye"}};
    const std::string prompt = apply_chat_template(read_text(kChatData + v.template_file), msgs, true);
    const std::vector<int32_t> ids = tok.encode(prompt, true, /*parse_special=*/true);
    const int32_t end = tok.token_id(v.end_of_turn);
    REQUIRE(end >= 0);
    CHECK(tok.is_eog(end));
    CHECK(std::count(ids.begin(), ids.end(), end) >= 2);
    for (int32_t id : ids) {
      if (id != end && id != tok.vocab().bos_id) CHECK_MESSAGE(!tok.is_eog(id), "token ", id, " ends generation");
    }
    // Encoded without parsing specials, the same text has no end-of-turn token.
    const std::vector<int32_t> plain = tok.encode(prompt, false, false);
    CHECK(std::count(plain.begin(), plain.end(), end) == 0);
  }
}

}  // namespace test_chat
