/* version.h — transom's version string, printed by `transom version`, the
 * run banner and the Lua module (transom.version). */
#ifndef TRANSOM_VERSION_H
#define TRANSOM_VERSION_H

#define TRANSOM_VERSION "0.1.0"

#endif
