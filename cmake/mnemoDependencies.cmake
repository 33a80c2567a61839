# The dependencies of mnemo::mnemo, shared by the build (CMakeLists.txt) and by the installed package
# (mnemoConfig.cmake). MNEMO_FIND is find_package in the build and find_dependency when installed.

# Eigen 3.4: Debian's config declares no version range, so ask for none and check the version.
MNEMO_FIND(Eigen3 NO_MODULE)
if(DEFINED Eigen3_VERSION AND Eigen3_VERSION VERSION_LESS 3.4)
  message(FATAL_ERROR "mnemo needs Eigen 3.4 or newer; found ${Eigen3_VERSION}")
endif()

# xsimd 8.1: Debian's xsimd target links a bare `xtl`; finding xtl first makes that name a target
# (otherwise the link fails with "cannot find -lxtl").
MNEMO_FIND(xtl)
MNEMO_FIND(xsimd)

MNEMO_FIND(OpenMP COMPONENTS CXX)
