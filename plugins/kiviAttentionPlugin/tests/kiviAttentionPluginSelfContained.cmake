# ctest kiviAttentionPluginSelfContained: the plugin library works as the single file TensorRT embeds in a plan
# (plugins-to-serialize) and later loads from a temporary directory. Run with cmake -P and
#   -DLIB=<libtrtllm_kivi_plugin.so> -DREADELF=<readelf> -DNM=<nm> -DLOAD_TEST=<kiviAttentionPluginLoadTest> -DDIR=<dir>
# Checks, on a copy of the library alone in DIR: no NEEDED entry names one of our libraries, the dynamic symbol table
# defines exactly the three entry points of kiviAttentionPlugin.map, and IPluginRegistry::loadLibrary on the copy
# registers the creator (kiviAttentionPluginLoadTest).

foreach(_var LIB READELF NM LOAD_TEST DIR)
  if(NOT DEFINED ${_var})
    message(FATAL_ERROR "kiviAttentionPluginSelfContained.cmake: -D${_var}=... is required")
  endif()
endforeach()

file(REMOVE_RECURSE ${DIR})
file(MAKE_DIRECTORY ${DIR})
get_filename_component(_name ${LIB} NAME)
file(COPY ${LIB} DESTINATION ${DIR})
set(_copy ${DIR}/${_name})

# 1. Dependencies: system libraries only (libcudart, libstdc++, libc ...), nothing built here.
execute_process(COMMAND ${READELF} -d ${_copy} OUTPUT_VARIABLE _dynamic RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "${READELF} -d ${_copy} failed (${_rc})")
endif()
string(REGEX MATCHALL "\\(NEEDED\\)[^\n]*\\[[^]\n]+\\]" _entries "${_dynamic}")
set(_needed "")
foreach(_entry IN LISTS _entries)
  string(REGEX REPLACE ".*\\[([^]]+)\\]" "\\1" _lib "${_entry}")
  if(_lib MATCHES "trtllm_kivi")
    message(FATAL_ERROR "${_name} is not self-contained: it needs ${_lib}")
  endif()
  list(APPEND _needed ${_lib})
endforeach()
if(NOT _needed MATCHES "libc\\.so")
  message(FATAL_ERROR "no NEEDED entries (not even libc) parsed from ${READELF} -d ${_copy}:\n${_dynamic}")
endif()

# 2. Exports: exactly the loadLibrary entry points and kiviGetFormatVersion.
execute_process(COMMAND ${NM} -D --defined-only ${_copy} OUTPUT_VARIABLE _symbols RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "${NM} -D --defined-only ${_copy} failed (${_rc})")
endif()
string(REGEX MATCHALL "[^ \n]+\n" _names "${_symbols}\n")
set(_exported "")
foreach(_line IN LISTS _names)
  string(STRIP "${_line}" _line)
  if(NOT _line STREQUAL "")
    list(APPEND _exported ${_line})
  endif()
endforeach()
list(SORT _exported)
if(NOT _exported STREQUAL "getCreators;kiviGetFormatVersion;setLoggerFinder")
  message(FATAL_ERROR "${_name} exports '${_exported}'; expected exactly getCreators;kiviGetFormatVersion;"
                      "setLoggerFinder (kiviAttentionPlugin.map)")
endif()

# 3. Loadable from that directory alone, the way TensorRT loads an embedded plugin library.
execute_process(COMMAND ${LOAD_TEST} ${_copy} loadLibrary RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "kiviAttentionPluginLoadTest ${_copy} loadLibrary failed (${_rc})")
endif()
message(STATUS "${_name} is self-contained: needs ${_needed}; exports ${_exported}")
