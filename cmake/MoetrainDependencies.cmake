# Third-party dependencies, all from the system's packages. Version differences between
# Debian 12 (yaml-cpp 0.7, Catch2 2.13, spdlog 1.10) and Ubuntu 24.04 (yaml-cpp 0.8, Catch2 3.4,
# spdlog 1.12) are absorbed here, so the rest of the build names one target per library:
#   moetrain::yaml  moetrain::catch2_main  spdlog::spdlog  fmt::fmt  cxxopts::cxxopts
#   nlohmann_json::nlohmann_json  ZLIB::ZLIB  MPI::MPI_CXX  (CUDA::cublasLt NCCL::NCCL with CUDA)

find_package(MPI REQUIRED COMPONENTS CXX)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(ZLIB REQUIRED)
find_package(Threads REQUIRED)

# cxxopts is header-only; older packages install no CMake config.
find_package(cxxopts QUIET)
if(NOT TARGET cxxopts::cxxopts)
  find_path(CXXOPTS_INCLUDE_DIR cxxopts.hpp REQUIRED)
  add_library(cxxopts::cxxopts INTERFACE IMPORTED)
  set_target_properties(cxxopts::cxxopts PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${CXXOPTS_INCLUDE_DIR}")
endif()

# yaml-cpp 0.7 exports the target `yaml-cpp`, 0.8 exports `yaml-cpp::yaml-cpp`.
find_package(yaml-cpp REQUIRED)
add_library(moetrain_yaml INTERFACE)
if(TARGET yaml-cpp::yaml-cpp)
  target_link_libraries(moetrain_yaml INTERFACE yaml-cpp::yaml-cpp)
elseif(TARGET yaml-cpp)
  target_link_libraries(moetrain_yaml INTERFACE yaml-cpp)
  # 0.7's config sets YAML_CPP_INCLUDE_DIR but no usage requirements on the target.
  if(YAML_CPP_INCLUDE_DIR)
    target_include_directories(moetrain_yaml SYSTEM INTERFACE "${YAML_CPP_INCLUDE_DIR}")
  endif()
else()
  message(FATAL_ERROR "yaml-cpp was found but exports neither yaml-cpp::yaml-cpp nor yaml-cpp")
endif()
add_library(moetrain::yaml ALIAS moetrain_yaml)

if(MOETRAIN_HAVE_CUDA)
  find_package(NCCL REQUIRED)
endif()

# Catch2 3 ships Catch2::Catch2WithMain and <catch2/catch_all.hpp>; Catch2 2 is one header
# <catch2/catch.hpp> and needs a translation unit defining main. tests/support/catch.h hides
# the header difference; this target hides the main difference.
if(MOETRAIN_TESTS)
  find_package(Catch2 REQUIRED)
  add_library(moetrain_catch2_main STATIC "${PROJECT_SOURCE_DIR}/tests/support/catch_main.cpp")
  if(Catch2_VERSION VERSION_GREATER_EQUAL 3)
    target_link_libraries(moetrain_catch2_main PUBLIC Catch2::Catch2WithMain)
    target_compile_definitions(moetrain_catch2_main PUBLIC MOETRAIN_CATCH2_V3=1)
  else()
    target_link_libraries(moetrain_catch2_main PUBLIC Catch2::Catch2)
    target_compile_definitions(moetrain_catch2_main PUBLIC MOETRAIN_CATCH2_V3=0)
  endif()
  target_include_directories(moetrain_catch2_main PUBLIC "${PROJECT_SOURCE_DIR}/tests/support")
  add_library(moetrain::catch2_main ALIAS moetrain_catch2_main)
  message(STATUS "moetrain: Catch2 ${Catch2_VERSION}")
endif()
