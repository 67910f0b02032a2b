// A tiny Llama model loaded whole from the project's GGUF writer (model_seed.hpp): the file, its tokenizer and the
// model, for the fuzz targets and tests that run the runtime or the server on it.
#pragma once

#include "model/gguf.hpp"
#include "model/llama.hpp"
#include "model/tokenizer.hpp"
#include "model_seed.hpp"

namespace cascade::fuzz {

struct TinyModel {
  gguf::File file;
  Tokenizer tok;
  llama::Model model;
  explicit TinyModel(const ModelSeed& seed, llama::LinearPath path = llama::LinearPath::quantized)
      : file(gguf::File::from_bytes(model_file(seed), "tiny.gguf")), tok(load_vocab(file)),
        model(llama::Model::load(file, path)) {}
};

}  // namespace cascade::fuzz
