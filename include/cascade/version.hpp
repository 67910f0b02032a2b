// The library's version. CMakeLists.txt reads it from here (the project's one statement of it), so the
// header-only library, the installed package and the build agree.
#pragma once

#define CASCADE_VERSION_STRING "0.1.0"
