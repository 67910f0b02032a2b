// Chat formatting: ChatML (with SmolLM2's default system message) and Llama 3, exact strings.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "cascade/error.hpp"
#include "model/chat.hpp"
#include "model/gguf.hpp"
#include "model/tokenizer.hpp"

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
  const std::string gemma =
      "{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\n' + message['content'] + "
      "'<end_of_turn>\n' }}{% endfor %}";
  for (const std::string& t : {gemma, std::string()}) {
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
