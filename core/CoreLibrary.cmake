# moetrain_core: core/model, data, train, checkpoint, plan and run, above base, parallel and kernels.
file(GLOB MOETRAIN_CORE_SOURCES CONFIGURE_DEPENDS
  ${CMAKE_CURRENT_LIST_DIR}/model/*.cpp
  ${CMAKE_CURRENT_LIST_DIR}/train/*.cpp
  ${CMAKE_CURRENT_LIST_DIR}/data/*.cpp
  ${CMAKE_CURRENT_LIST_DIR}/checkpoint/*.cpp
  ${CMAKE_CURRENT_LIST_DIR}/plan/*.cpp
  ${CMAKE_CURRENT_LIST_DIR}/run/*.cpp)
if(MOETRAIN_CORE_SOURCES)
  add_library(moetrain_core STATIC ${MOETRAIN_CORE_SOURCES})
  target_link_libraries(moetrain_core
    PUBLIC moetrain_base moetrain_parallel moetrain_kernels_cpu
    PRIVATE spdlog::spdlog fmt::fmt)
  if(TARGET moetrain_kernels_cuda)
    target_link_libraries(moetrain_core PUBLIC moetrain_kernels_cuda)
  endif()
endif()
