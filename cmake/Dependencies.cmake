# Resolves the third-party libraries into attnd::* interface targets, shared (default) or static
# (ATTND_STATIC=ON). Debian's gRPC CMake package only describes its shared libraries, so the static mode
# collects the .a archives itself and links them as one group, which makes their order irrelevant.
find_package(Threads REQUIRED)
find_package(PkgConfig REQUIRED)

# spdlog and fmt ship no static archives on Debian: use them header-only in every mode.
find_package(fmt CONFIG REQUIRED)
find_package(spdlog CONFIG REQUIRED)
add_library(attnd_logging INTERFACE)
target_link_libraries(attnd_logging INTERFACE spdlog::spdlog_header_only fmt::fmt-header-only)
add_library(attnd::logging ALIAS attnd_logging)

find_program(ATTND_PROTOC protoc REQUIRED)
find_program(ATTND_GRPC_CPP_PLUGIN grpc_cpp_plugin REQUIRED)

if(NOT ATTND_STATIC)
  find_package(absl CONFIG REQUIRED)
  find_package(Protobuf REQUIRED)
  find_package(gRPC CONFIG REQUIRED)
  # gRPC's TLS library; the server checks a TLS key against its certificate with it (server/grpc/tls.cc).
  find_package(OpenSSL REQUIRED)
  add_library(attnd_absl INTERFACE)
  target_link_libraries(attnd_absl INTERFACE
    absl::status absl::statusor absl::strings absl::str_format absl::synchronization absl::time
    absl::flags absl::flags_parse absl::flags_usage absl::random_random absl::span absl::optional)
  add_library(attnd_grpc INTERFACE)
  target_link_libraries(attnd_grpc INTERFACE gRPC::grpc++ gRPC::grpc++_reflection protobuf::libprotobuf OpenSSL::Crypto
                                              attnd_absl)
  if(ATTND_BUILD_TESTS)
    find_package(GTest REQUIRED)
    add_library(attnd_gtest INTERFACE)
    target_link_libraries(attnd_gtest INTERFACE GTest::gtest GTest::gmock Threads::Threads)
    add_library(attnd_gtest_main INTERFACE)
    target_link_libraries(attnd_gtest_main INTERFACE GTest::gtest_main attnd_gtest)
  endif()
else()
  set(_libdir /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE})
  file(GLOB _absl_archives ${_libdir}/libabsl_*.a)
  if(NOT _absl_archives)
    message(FATAL_ERROR "ATTND_STATIC: no libabsl_*.a under ${_libdir}")
  endif()
  set(_grpc_names grpc++_reflection grpc++ grpc address_sorting upb re2 cares gpr protobuf ssl crypto z)
  set(_grpc_archives)
  foreach(_n IN LISTS _grpc_names)
    set(_a ${_libdir}/lib${_n}.a)
    if(NOT EXISTS ${_a})
      message(FATAL_ERROR "ATTND_STATIC: missing ${_a}")
    endif()
    list(APPEND _grpc_archives ${_a})
  endforeach()
  find_path(_absl_inc absl/status/status.h REQUIRED)
  # Every archive sits in ONE link group owned by one target: gRPC, protobuf, OpenSSL and abseil refer to each
  # other in cycles, and CMake de-duplicates archives listed by two targets, which would empty one group.
  add_library(attnd_static_deps INTERFACE)
  target_include_directories(attnd_static_deps SYSTEM INTERFACE ${_absl_inc})
  target_link_libraries(attnd_static_deps INTERFACE
    "-Wl,--start-group" ${_grpc_archives} ${_absl_archives} "-Wl,--end-group"
    Threads::Threads ${CMAKE_DL_LIBS} rt atomic)
  add_library(attnd_absl INTERFACE)
  target_link_libraries(attnd_absl INTERFACE attnd_static_deps)
  add_library(attnd_grpc INTERFACE)
  target_link_libraries(attnd_grpc INTERFACE attnd_static_deps)
  if(ATTND_BUILD_TESTS)
    add_library(attnd_gtest INTERFACE)
    target_link_libraries(attnd_gtest INTERFACE ${_libdir}/libgmock.a ${_libdir}/libgtest.a Threads::Threads)
    add_library(attnd_gtest_main INTERFACE)
    target_link_libraries(attnd_gtest_main INTERFACE ${_libdir}/libgtest_main.a attnd_gtest)
  endif()
endif()
# jemalloc: the `attnd` binary's allocator (server/CMakeLists.txt links it into that binary only, never into the
# client libraries or the Python package). Its idle purge hands back what every arena freed, where glibc's
# malloc_trim leaves its per-thread arenas' tops (docs/tuning.md). The static build links Debian's
# libjemalloc_pic.a (attnd is a position-independent executable), whole, so that its malloc serves the process.
# Fuzz builds leave it out: ASan brings its own allocator.
if(NOT ATTND_FUZZ)
  if(ATTND_STATIC)
    find_library(ATTND_JEMALLOC_LIBRARY NAMES libjemalloc_pic.a)
  else()
    find_library(ATTND_JEMALLOC_LIBRARY NAMES jemalloc)
  endif()
  if(NOT ATTND_JEMALLOC_LIBRARY)
    message(FATAL_ERROR "jemalloc not found: install libjemalloc-dev (scripts/install_deps.sh)")
  endif()
  add_library(attnd_jemalloc INTERFACE)
  if(ATTND_STATIC)
    target_link_libraries(attnd_jemalloc INTERFACE
      "-Wl,--whole-archive" ${ATTND_JEMALLOC_LIBRARY} "-Wl,--no-whole-archive" Threads::Threads ${CMAKE_DL_LIBS} m)
  else()
    # --no-as-needed: a linker that drops unreferenced libraries (Ubuntu's default) would leave glibc's malloc.
    target_link_libraries(attnd_jemalloc INTERFACE
      "-Wl,--push-state,--no-as-needed" ${ATTND_JEMALLOC_LIBRARY} "-Wl,--pop-state")
  endif()
  add_library(attnd::jemalloc ALIAS attnd_jemalloc)
endif()
# Prometheus metrics: prometheus-cpp (registry, text format 0.0.4, and an HTTP exposer on civetweb). Debian ships
# neither as a static archive, so the static build leaves the metrics endpoint out (--metrics_listen is refused).
set(ATTND_HAVE_METRICS OFF)
if(NOT ATTND_STATIC)
  find_package(prometheus-cpp CONFIG QUIET)
  if(TARGET prometheus-cpp::core AND TARGET prometheus-cpp::pull)
    set(ATTND_HAVE_METRICS ON)
  endif()
endif()
message(STATUS "attnd: Prometheus metrics endpoint ${ATTND_HAVE_METRICS}")
add_library(attnd::absl ALIAS attnd_absl)
add_library(attnd::grpc ALIAS attnd_grpc)
if(TARGET attnd_gtest)
  add_library(attnd::gtest ALIAS attnd_gtest)
  add_library(attnd::gtest_main ALIAS attnd_gtest_main)  # attnd::gtest plus gtest's main()
endif()
