# attnd_library(NAME SOURCES file... [PUBLIC_INCLUDE dir] [PRIVATE_INCLUDE dir] LINK target...): one part of attnd
# as a static library: its sources, its include folder (public: the headers its users include; private: its own),
# the targets it links publicly, the project's warnings (on its C++ sources), and the alias attnd::X for NAME attnd_X.
function(attnd_library name)
  cmake_parse_arguments(arg "" "PUBLIC_INCLUDE;PRIVATE_INCLUDE" "SOURCES;LINK" ${ARGN})
  add_library(${name} STATIC ${arg_SOURCES})
  if(arg_PUBLIC_INCLUDE)
    target_include_directories(${name} PUBLIC ${arg_PUBLIC_INCLUDE})
  endif()
  if(arg_PRIVATE_INCLUDE)
    target_include_directories(${name} PRIVATE ${arg_PRIVATE_INCLUDE})
  endif()
  target_link_libraries(${name} PUBLIC ${arg_LINK})
  target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${ATTND_WARNINGS}>)
  string(REGEX REPLACE "^attnd_" "" alias ${name})
  add_library(attnd::${alias} ALIAS ${name})
endfunction()
