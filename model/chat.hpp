// Chat formatting: turns a list of messages into the prompt text a chat model was trained on.
//
// No Jinja engine: the model's `tokenizer.chat_template` is only inspected to recognize its format (and the
// variant of it), then the format is written out directly, as the template writes it for plain text messages
// (tests/data/chat: each format checked against its templates rendered by Jinja). Recognized, by what the
// template mentions (first match):
//   ChatML (<|im_start|>; SmolLM2, Qwen 2, Qwen 2.5, Qwen 3):
//     <|im_start|>ROLE\nCONTENT<|im_end|>\n ...   generation prompt: <|im_start|>assistant\n
//     A template that writes a literal default system message when the first message is not a system one
//     (SmolLM2: "You are a helpful AI assistant named SmolLM, trained by Hugging Face"; Qwen 2.5: "You are
//     Qwen, created by Alibaba Cloud. You are a helpful assistant.") gets it here too.
//     Qwen 3 (the template mentions <think>): an assistant message before the last user message loses its
//     reasoning (the text up to </think>); one after it is written as <think>\nREASONING\n</think>\n\nANSWER,
//     the reasoning empty when it has none and it is the last message.
//   Mistral ([INST]), three variants:
//     v1 (Mistral 7B Instruct v0.1 and v0.2 as now published: ' [INST] '):
//       " [INST] USER [/INST]" and " ASSISTANT</s>"; the system message opens the first user turn ("SYSTEM\n\n").
//     v3 (Mistral 7B Instruct v0.3: [AVAILABLE_TOOLS]):
//       "[INST] USER[/INST]" and " TRIMMED ASSISTANT</s>"; the system message opens the last user turn when that
//       is the last message (else it is left out, as the template does).
//     legacy (as first published, no system message): "[INST] USER [/INST]" and "ASSISTANT</s>"; its template
//       refuses a system message, which is written here as v1 writes it.
//     No generation prompt: the prompt ends with [/INST].
//   Phi-3 (<|assistant|> and <|end|>), two variants:
//     <|ROLE|>\nCONTENT<|end|>\n (system, user, assistant; Phi-3.5 skips an empty system message), generation
//     prompt <|assistant|>\n, else <|endoftext|> where the template ends with eos_token;
//     the first Phi-3 mini/medium template (no <|system|>): <|user|>\nUSER<|end|>\n<|assistant|>\n and
//     ASSISTANT<|end|>\n, system messages left out, the generation prompt always there after a user turn.
//   Gemma 3 (<start_of_turn>):
//     <start_of_turn>ROLE\nTRIMMED CONTENT<end_of_turn>\n, "assistant" written as "model"; a first system message
//     is not a turn: "SYSTEM\n\n" opens the first turn. Generation prompt: <start_of_turn>model\n
//   Llama 3 (<|start_header_id|>):
//     <|start_header_id|>ROLE<|end_header_id|>\n\nTRIMMED CONTENT<|eot_id|> ...
//     generation prompt: <|start_header_id|>assistant<|end_header_id|>\n\n
//     (Llama 3.1's template also writes a dated system header; that is not written.)
// Trimming is Jinja's: Python's str.strip(), Unicode whitespace. Roles a format has no place for (Phi-3, Gemma and
// Mistral: other than system, user, assistant) are left out; ChatML and Llama 3 write any role.
// The BOS token is never written: encode(text, add_special = true) adds it where the vocabulary asks.
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

enum class ChatFormat { chatml, llama3, phi3, gemma, mistral };

// Recognizes the format of a chat template; throws cascade::Error for an empty or unknown one.
ChatFormat detect_chat_format(std::string_view template_text);

// The names a caller may give instead of a template (cascade-server's --chat-template): "chatml", "llama3",
// "phi3", "gemma", "mistral" (v3); a minimal template text that detect_chat_format recognizes as that format, or
// empty for an unknown name.
std::string builtin_chat_template(std::string_view name);

// ChatML only: the default system message the template inserts when the first message is not a system
// message; empty when it has none.
std::string chatml_default_system(std::string_view template_text);

// The prompt for msgs in the template's format, ending with the assistant's header when add_generation_prompt
// (where the format has one). Throws cascade::Error (suggesting a raw prompt without --chat) when the template is
// not recognized.
std::string apply_chat_template(std::string_view template_text, const std::vector<ChatMessage>& msgs,
                                bool add_generation_prompt);

}  // namespace cascade
