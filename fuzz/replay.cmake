# The fuzz targets' seeds as tests, without libFuzzer (CASCADE_FUZZ_REPLAY; scripts/sanitize.sh turns it on, so the
# suite under ASan and UBSan runs them): each target's entry point (fuzz/fuzz_*.cpp) linked with replay_main.cpp and
# the build's own libraries, by any compiler. fuzz_seeds writes the seeds into the build tree first (a ctest
# fixture); then one test per target runs every seed, and random mutations of them for CASCADE_FUZZ_REPLAY_SECONDS
# (a mutated input that a sanitizer stops is kept as crash-fuzz_replay_TARGET-SEED in the build folder).
# Coverage-guided fuzzing, which finds far more, is libFuzzer's, in scripts/fuzz.sh.
set(CASCADE_FUZZ_REPLAY_SECONDS 4 CACHE STRING "Seconds of random mutations per fuzz target in its replay test")
set(fuzz_dir ${PROJECT_SOURCE_DIR}/fuzz)
set(seed_dir ${PROJECT_BINARY_DIR}/fuzz-replay-seeds)
set(fuzz_defs CASCADE_EXTERN_KERNELS=1 CASCADE_TESTDATA_DIR="${PROJECT_SOURCE_DIR}/tests/data"
              CASCADE_MODEL_PATH="${PROJECT_SOURCE_DIR}/models/SmolLM2-135M-Instruct.Q4_1.gguf")

# replay_main.cpp once, for every target.
add_library(fuzz_replay_main OBJECT ${fuzz_dir}/replay_main.cpp)
target_link_libraries(fuzz_replay_main PRIVATE cascade cascade_flags)  # C++20 and the build's flags

add_executable(fuzz_seeds_writer ${fuzz_dir}/fuzz_seeds.cpp)
target_link_libraries(fuzz_seeds_writer PRIVATE cascade_model cascade_flags)
target_compile_definitions(fuzz_seeds_writer PRIVATE ${fuzz_defs})
add_test(NAME "fuzz replay: write the seeds" COMMAND fuzz_seeds_writer ${seed_dir})
set_tests_properties("fuzz replay: write the seeds" PROPERTIES FIXTURES_SETUP fuzz_seeds LABELS fuzz_replay)

foreach(name gguf tokenizer plan model request)
  add_executable(fuzz_replay_${name} ${fuzz_dir}/fuzz_${name}.cpp $<TARGET_OBJECTS:fuzz_replay_main>)
  target_link_libraries(fuzz_replay_${name} PRIVATE cascade_model cascade_flags)
  target_compile_definitions(fuzz_replay_${name} PRIVATE ${fuzz_defs})
  add_test(NAME "fuzz replay: ${name}"
           COMMAND fuzz_replay_${name} --mutate ${CASCADE_FUZZ_REPLAY_SECONDS} ${seed_dir}/${name}
           WORKING_DIRECTORY ${PROJECT_BINARY_DIR})
  set_tests_properties("fuzz replay: ${name}" PROPERTIES FIXTURES_REQUIRED fuzz_seeds LABELS fuzz_replay)
endforeach()
target_link_libraries(fuzz_replay_request PRIVATE cascade_server)
