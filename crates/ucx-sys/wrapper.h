/* Everything tandem needs from UCX: the UCP API (which pulls in the ucs types it uses) and
 * the status helpers. */
#include <ucp/api/ucp.h>
#include <ucs/type/status.h>
