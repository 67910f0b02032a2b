// Chat formatting: turns a list of messages into the prompt text a chat model was trained on.
//
// No Jinja engine: the model's `tokenizer.chat_template` is only inspected to recognize its format, then the
// format is written out directly (as llama.cpp's built-in templates do):
//   ChatML (the template mentions <|im_start|>; SmolLM2, Qwen, ...):
//     <|im_start|>ROLE\nCONTENT<|im_end|>\n ...   generation prompt: <|im_start|>assistant\n
//     A template that writes a literal default system message when the first message is not a system one
//     (SmolLM2: "You are a helpful AI assistant named SmolLM, trained by Hugging Face") gets it here too.
//   Llama 3 (the template mentions <|start_header_id|>):
//     <|start_header_id|>ROLE<|end_header_id|>\n\nTRIMMED CONTENT<|eot_id|> ...
//     generation prompt: <|start_header_id|>assistant<|end_header_id|>\n\n
//     The BOS token is not written: encode(text, add_special = true) adds it.
// The result holds special tokens as text: encode it with parse_special = true.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace cascade {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", ...
  std::string content;
};

enum class ChatFormat { chatml, llama3 };

// Recognizes the format of a chat template; throws cascade::Error for an empty or unknown one.
ChatFormat detect_chat_format(std::string_view template_text);

// ChatML only: the default system message the template inserts when the first message is not a system
// message; empty when it has none.
std::string chatml_default_system(std::string_view template_text);

// The prompt for msgs in the template's format, ending with the assistant header when add_generation_prompt.
// Throws cascade::Error (suggesting a raw prompt without --chat) when the template is not recognized.
std::string apply_chat_template(std::string_view template_text, const std::vector<ChatMessage>& msgs,
                                bool add_generation_prompt);

}  // namespace cascade
