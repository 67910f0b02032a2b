# Installs cascade into a scratch prefix, then configures and builds an outside project that uses
# find_package(cascade) and links cascade::cascade. Its source is the ```cpp example in README.md,
# extracted here, so the README's example can't rot. The example is run too.
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
endfunction()

run(${CMAKE_CMD} -S "${SOURCE_DIR}" -B "${WORK_DIR}/lib-build" -DCASCADE_BUILD_TESTS=OFF -DCASCADE_BUILD_TOOLS=OFF
    -DCASCADE_BUILD_BENCH=OFF -DCASCADE_CUDA=OFF "-DCMAKE_INSTALL_PREFIX=${WORK_DIR}/prefix")
run(${CMAKE_CMD} --install "${WORK_DIR}/lib-build")

file(READ "${SOURCE_DIR}/README.md" readme)
string(FIND "${readme}" "```cpp\n" begin)
if(begin EQUAL -1)
  message(FATAL_ERROR "README.md has no ```cpp block")
endif()
math(EXPR begin "${begin} + 7")
string(SUBSTRING "${readme}" ${begin} -1 rest)
string(FIND "${rest}" "```" end)
string(SUBSTRING "${rest}" 0 ${end} example)
file(WRITE "${WORK_DIR}/app/main.cpp" "${example}")
file(COPY "${SOURCE_DIR}/tests/consumer/CMakeLists.txt" DESTINATION "${WORK_DIR}/app")

# A Debug build: the example's one file instantiates every kernel tier of the header-only library, which took
# over a minute to optimize (the longest test of the suite); what this test checks is that the installed package
# is found, compiles and links, and that the example's answer is right, which needs no optimizer.
run(${CMAKE_CMD} -S "${WORK_DIR}/app" -B "${WORK_DIR}/app-build" "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix"
    -DCMAKE_BUILD_TYPE=Debug)
run(${CMAKE_CMD} --build "${WORK_DIR}/app-build")
run("${WORK_DIR}/app-build/readme_example")
message(STATUS "consumer project built against the installed cascade and ran")
